"""Any diffusers pipeline served with no code of ours ("diffusers-pipeline", mdtriton.pipeline.any_pipeline): its
request read off its call at build time, its transformer split by its own plan on 2 gloo ranks. WanPipeline (a
video) and FluxPipeline (an image) equal diffusers' pipeline in one process within 1 uint8 level; bad requests are
refused and the server serves on; a pipeline whose call needs what a request cannot carry is refused at build."""

from __future__ import annotations

import json

import diffusers
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.pipeline import infer_inputs, texts
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.any_pipeline import step_cache_offer
from mdtriton.testing.tiny_flux_pipeline import save_tiny_flux_pipeline
from mdtriton.testing.tiny_wan_pipeline import reference_video, save_tiny_wan_pipeline
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference, reference_image

WAN = dict(prompt=["a red cat on a blue mat"], negative_prompt=["blurry"], height=32, width=48, num_frames=5,
           num_inference_steps=2, guidance_scale=4.0, seed=5)
FLUX = dict(prompt=["a red cat on a blue mat"], height=64, width=48, num_inference_steps=2, guidance_scale=3.5, seed=3)
TYPES = {"height": np.int32, "width": np.int32, "num_frames": np.int32, "num_inference_steps": np.int32,
         "guidance_scale": np.float32, "seed": np.int64, "max_sequence_length": np.int32}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Tiny Wan 2.1 and FLUX.1 directories, and a server of each built as diffusers-pipeline on 2 ranks (Wan by
    Ulysses, FLUX by ring)."""
    root = tmp_path_factory.mktemp("any-pipeline")
    wan_dir = save_tiny_wan_pipeline(root / "wan")
    flux_dir = save_tiny_flux_pipeline(root / "flux")
    repository = root / "repository"
    for name, pipeline_dir, method in (("wan", wan_dir, "ulysses"), ("flux", flux_dir, "ring")):
        build_model_version(repository, name, BuildRequest(
            "diffusers-pipeline", None, ParallelPlan(cp_size=2, cp_method=method), "FP32", "cpu",
            weights_path=pipeline_dir, progress=False))
    server = start_server(repository, root / "server.log")
    yield wan_dir, flux_dir, server
    server.stop()


def ask(server, model: str, request: dict, output: str) -> np.ndarray:
    return ask_with_steps(server, model, request, output)[0]


def ask_with_steps(server, model: str, request: dict, output: str, cache: str | None = None) -> tuple[np.ndarray, int]:
    """The request's output, with a step cache (a JSON object as text; None: none), and its full_steps."""
    arrays = {name: texts(value) if isinstance(value, list) else np.array([value], TYPES[name])
              for name, value in request.items()}
    if cache is not None:
        arrays["cache"] = texts([cache])
    with grpcclient.InferenceServerClient(server.grpc_address) as client:
        result = client.infer(model, infer_inputs(arrays), client_timeout=300)
    return result.as_numpy(output), int(result.as_numpy("full_steps")[0])


def test_a_video_pipeline_equals_diffusers_in_one_process(served):
    wan_dir, _, server = served
    video = ask(server, "wan", WAN, "video")
    assert video.shape == (1, 5, 32, 48, 3)
    expected = reference_video(wan_dir, WAN["prompt"], 32, 48, 5, 2, 4.0, 5, negative_prompt=WAN["negative_prompt"])
    assert max_level_difference(video, expected) <= 1
    assert ("mdtriton rank 1 worker: WanTransformer3DModel split by its context-parallel plan across 2 ranks "
            "(ulysses)") in server.log_file.read_text()


def test_first_block_cache_equals_diffusers_where_the_pipeline_meets_it(served):
    """WanPipeline names its calls' cache contexts and diffusers' hooks know its blocks: First Block Cache equals
    diffusers' with the same config (the tiny pipeline's ratios at steps 1 to 3 of 4 at 0.3: 0.098, 0.146, 0.234;
    each step after the first skipped). Its attention modules are not named as TaylorSeer's default patterns
    take (TaylorSeer would predict nothing): refused, saying so."""
    wan_dir, _, server = served
    request = {**WAN, "num_inference_steps": 4}
    video, ran = ask_with_steps(server, "wan", request, "video", '{"method": "first_block", "threshold": 0.3}')
    expected = reference_video(wan_dir, WAN["prompt"], 32, 48, 5, 4, 4.0, 5, cache_threshold=0.3,
                               negative_prompt=WAN["negative_prompt"])
    assert max_level_difference(video, expected) <= 1 and ran == 1
    uncached = reference_video(wan_dir, WAN["prompt"], 32, 48, 5, 4, 4.0, 5, negative_prompt=WAN["negative_prompt"])
    assert max_level_difference(expected, uncached) > 1
    with pytest.raises(InferenceServerException) as refused:
        ask_with_steps(server, "wan", request, "video", '{"method": "taylorseer"}')
    assert "INVALID_ARG" in str(refused.value.status())
    assert ("cache method 'taylorseer' is not offered by diffusers-pipeline; its methods: first_block, none "
            "(TaylorSeer: no attention module of WanTransformer3DModel is named as its default patterns take)"
            ) in refused.value.message()


def test_an_image_pipeline_equals_diffusers_in_one_process(served):
    _, flux_dir, server = served
    image = ask(server, "flux", FLUX, "image")
    assert image.shape == (1, 64, 48, 3)
    assert max_level_difference(image, reference_image(flux_dir, FLUX["prompt"], 64, 48, 2, 3.5, 3)) <= 1


def test_the_request_is_read_off_the_call(served):
    """The served inputs are the call's parameters a request can carry, with the call's defaults (config.pbtxt's
    request_defaults, which `mdtriton generate` reads)."""
    _, _, server = served
    with grpcclient.InferenceServerClient(server.grpc_address) as client:
        config = client.get_model_config("wan", as_json=True)["config"]
    names = [spec["name"] for spec in config["input"]]
    assert names == ["prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps",
                     "guidance_scale", "guidance_scale_2", "max_sequence_length", "seed", "cache", "loras"]
    defaults = json.loads(config["parameters"]["request_defaults"]["string_value"])
    assert defaults == {"negative_prompt": None, "height": 480, "width": 832, "num_frames": 81,
                        "num_inference_steps": 50, "guidance_scale": 5.0, "guidance_scale_2": None,
                        "max_sequence_length": 512, "seed": 0}
    assert [spec["name"] for spec in config["output"]] == ["video", "step", "full_steps"]


@pytest.mark.parametrize("change, message", [
    ({"height": 36}, "height 36 is not a positive multiple of 8"),
    ({"num_frames": 0}, "num_frames 0 is out of range; send 1 to 1025"),
    ({"height": 4096, "width": 4096}, "over this model's maximum of 32768"),
    ({"negative_prompt": ["a", "b"]}, "negative_prompt has 2 rows, prompt 1"),
    ({"guidance_scale": float("inf")}, "guidance_scale inf is not finite"),
    ({"num_inference_steps": 0}, "num_inference_steps 0 is out of range"),
])
def test_bad_requests_are_invalid_argument_and_the_server_serves_on(served, change, message):
    _, _, server = served
    with pytest.raises(InferenceServerException) as refused:
        ask(server, "wan", {**WAN, **change}, "video")
    assert "INVALID_ARG" in str(refused.value.status()) and message in refused.value.message()


def test_what_only_the_pipeline_knows_it_refuses_itself_and_the_ranks_serve_on(served):
    """A text length over FluxPipeline's T5 limit is the pipeline's to judge (the server takes up to 4,096 for any
    pipeline): the answer says what diffusers says, and the next request is answered."""
    _, _, server = served
    with pytest.raises(InferenceServerException) as refused:
        ask(server, "flux", {**FLUX, "max_sequence_length": 600}, "image")
    assert "`max_sequence_length` cannot be greater than 512 but is 600" in refused.value.message()
    assert ask(server, "flux", FLUX, "image").shape == (1, 64, 48, 3)


@pytest.mark.parametrize("pipeline_class, transformer_class, methods, contexts, note", [
    ("Flux2Pipeline", "Flux2Transformer2DModel", ["taylorseer"], ["cond"],
     "First Block Cache: Flux2Transformer2DModel's blocks (Flux2SingleTransformerBlock, Flux2TransformerBlock) are not "
     "at least two that diffusers' block hooks know, of one return layout"),
    ("FluxKontextPipeline", "FluxTransformer2DModel", [], None,
     "FluxKontextPipeline calls its transformer without naming a cache context, other than once a step"),
    ("LTX2Pipeline", "LTX2VideoTransformer3DModel", ["taylorseer"], None,
     "First Block Cache: LTX2VideoTransformer3DModel's blocks (LTX2VideoTransformerBlock) are not"),
    ("FluxPipeline", "FluxTransformer2DModel", ["first_block", "taylorseer"], None, ""),
    ("WanPipeline", "WanTransformer3DModel", [], None, "WanPipeline has a second transformer (transformer_2)"),
])
def test_the_build_offers_the_step_cache_the_pipeline_meets(tmp_path, pipeline_class, transformer_class, methods,
                                                            contexts, note):
    """Read off the pipeline's call (its cache contexts, or its one unnamed call a step), its transformers (one) and
    its transformer's modules (its class's default config, on the meta device): what is not offered says why."""
    (tmp_path / "transformer").mkdir()
    index = {"_class_name": pipeline_class}
    if pipeline_class == "WanPipeline":  # Wan 2.2 A14B: a low-noise expert beside the transformer
        index["transformer_2"] = ["diffusers", transformer_class]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": transformer_class}))
    offer = step_cache_offer(getattr(diffusers, pipeline_class), tmp_path)
    assert (offer["cache_methods"], offer["cache_contexts"]) == (methods, contexts)
    assert note in offer["cache_note"] and bool(note) == bool(offer["cache_note"])


def test_a_pipeline_whose_call_needs_what_a_request_cannot_carry_is_refused_at_build(tmp_path):
    pipeline_dir = tmp_path / "animate"
    pipeline_dir.mkdir()
    (pipeline_dir / "model_index.json").write_text(json.dumps({"_class_name": "WanAnimatePipeline"}))
    with pytest.raises(EngineError, match="WanAnimatePipeline cannot be served as diffusers-pipeline: its call "
                                          "requires 'pose_video'"):
        build_model_version(tmp_path / "repository", "animate", BuildRequest(
            "diffusers-pipeline", None, ParallelPlan(), "FP32", "cpu", weights_path=pipeline_dir, progress=False))
    (pipeline_dir / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline"}))
    with pytest.raises(EngineError, match="has no pipeline class 'NoSuchPipeline'"):
        build_model_version(tmp_path / "repository", "animate", BuildRequest(
            "diffusers-pipeline", None, ParallelPlan(), "FP32", "cpu", weights_path=pipeline_dir, progress=False))
    assert not (tmp_path / "repository" / "animate").exists()
