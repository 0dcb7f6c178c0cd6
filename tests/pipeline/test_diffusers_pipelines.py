"""Pipelines served with diffusers' own transformer, split by its own context-parallel plan
(mdtriton.pipeline.generic): Qwen-Image and FLUX.2 [klein] on 2 gloo ranks, each method, equal diffusers' pipeline in
one process within 1 uint8 level, with and without a step cache (diffusers' cache hooks, First Block Cache's decision
agreed across the ranks; the plans these servers are not built with: tests/pipeline/test_pipeline_plans.py); bad
requests are refused and the server serves on."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from diffusers import Flux2KleinPipeline, QwenImagePipeline
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
from PIL import Image
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.pipeline import image_arrays, infer_inputs, request_arrays
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.testing.tiny_flux2_pipeline import save_tiny_flux2_klein_pipeline
from mdtriton.testing.tiny_qwen_image_pipeline import save_tiny_qwen_image_pipeline
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference

METHODS = ("ulysses", "ring", "allgather_kv")
REQUEST = dict(prompt=["a red cat on a blue mat"], negative_prompt=["blurry"], height=64, width=48,
               num_inference_steps=2, true_cfg_scale=4.0, seed=7)


def served_pipeline(root, save, architecture: str, methods: tuple[str, ...], prefix: str,
                    plans: dict[str, ParallelPlan] | None = None):
    """A tiny pipeline's directory (save writes it) and a server of it built on 2 ranks by each method, as
    PREFIX-METHOD, and by each of plans, as PREFIX-NAME."""
    pipeline_dir = save(root / "pipeline")
    repository = root / "repository"
    plans = {**{method: ParallelPlan(cp_size=2, cp_method=method) for method in methods}, **(plans or {})}
    for name, plan in plans.items():
        build_model_version(repository, f"{prefix}-{name}", BuildRequest(
            architecture, None, plan, "FP32", "cpu", weights_path=pipeline_dir, progress=False))
    return pipeline_dir, start_server(repository, root / "server.log")


# Guidance parallelism: the conditional and unconditional calls on 2 ranks.
GUIDANCE_PLANS = {"cfg": ParallelPlan(cfg_size=2)}


@pytest.fixture(scope="module")
def qwen_image(tmp_path_factory):
    """The tiny Qwen-Image directory (two blocks: First Block Cache's first and last) and a server of it built on 2
    ranks by each method and by guidance."""
    pipeline_dir, server = served_pipeline(tmp_path_factory.mktemp("qwen-image"),
                                           partial(save_tiny_qwen_image_pipeline, num_layers=2),
                                           "qwen-image-pipeline", METHODS, "qwen", GUIDANCE_PLANS)
    yield pipeline_dir, server
    server.stop()


def reference(pipeline_dir, request: dict, pipeline_class=QwenImagePipeline, cache=None, cache_context=None,
              **load_arguments) -> np.ndarray:
    """diffusers' pipeline in this process with the directory's components (and load_arguments) for a request as
    `served` takes it (its `images`, UINT8 arrays, given to the pipeline as PIL images), after
    `transformer.enable_cache(cache)` where a diffusers cache config is given, and run under
    `transformer.cache_context(cache_context)` where one is given (a pipeline that names none)."""
    pipeline = pipeline_class.from_pretrained(pipeline_dir, local_files_only=True, **load_arguments)
    pipeline.set_progress_bar_config(disable=True)
    if cache is not None:
        pipeline.transformer.enable_cache(cache)
    arguments = {key: value for key, value in request.items() if key not in ("seed", "images")}
    if "images" in request:
        arguments["image"] = [Image.fromarray(image) for image in request["images"]]
    with pipeline.transformer.cache_context(cache_context) if cache_context else nullcontext():
        images = pipeline(**arguments, generator=torch.Generator().manual_seed(request["seed"]),
                          output_type="np").images
    return (images * 255).round().astype(np.uint8)


def served(server, model: str, request: dict) -> np.ndarray:
    """The served image of a request: its texts, numbers and `images` (sent as image, image_2, image_3) or, for
    requests the client would not make, `arrays` (input arrays by name, sent as they are)."""
    return served_with_steps(server, model, request)[0]


def served_with_steps(server, model: str, request: dict, cache: dict | str | None = None) -> tuple[np.ndarray, int]:
    """The served image of a request (as `served` sends it) with a step cache (None: none), and its full_steps."""
    texts = {name: request.get(name) for name in ("prompt", "negative_prompt")}
    numbers = {name: value for name, value in request.items() if name not in (*texts, "images", "arrays")}
    arrays = {**request_arrays(texts, numbers, cache, None), **image_arrays(request.get("images", [])),
              **request.get("arrays", {})}
    with grpcclient.InferenceServerClient(server.grpc_address) as client:
        result = client.infer(model, infer_inputs(arrays), client_timeout=300)
    return result.as_numpy("image"), int(result.as_numpy("full_steps")[0])


@pytest.mark.parametrize("method", METHODS)
def test_each_method_equals_diffusers_in_one_process(qwen_image, method):
    pipeline_dir, server = qwen_image
    image = served(server, f"qwen-{method}", REQUEST)
    assert image.shape == (1, 64, 48, 3)
    assert max_level_difference(image, reference(pipeline_dir, REQUEST)) <= 1


@pytest.mark.parametrize("plan", GUIDANCE_PLANS)
def test_guidance_parallelism_equals_diffusers_in_one_process(qwen_image, plan):
    """Each guidance group runs one branch of the guided steps; a request without a negative prompt (no guidance)
    runs alike on both groups."""
    pipeline_dir, server = qwen_image
    assert max_level_difference(served(server, f"qwen-{plan}", REQUEST), reference(pipeline_dir, REQUEST)) <= 1
    log = server.log_file.read_text()
    layout = GUIDANCE_PLANS[plan]
    for rank in range(layout.world_size):
        branch = "unconditional" if layout.cfg_rank(rank) else "conditional"
        assert (f"mdtriton rank {rank} worker: QwenImageTransformer2DModel split by guidance: this rank runs the "
                f"{branch} branch") in log
    unguided = {key: value for key, value in REQUEST.items() if key != "negative_prompt"}
    assert max_level_difference(served(server, f"qwen-{plan}", unguided), reference(pipeline_dir, unguided)) <= 1


@pytest.mark.parametrize("change, message", [
    ({"height": 60}, "height 60 is not a positive multiple of 16"),
    ({"true_cfg_scale": float("nan")}, "true_cfg_scale"),
    ({"num_inference_steps": 0}, "num_inference_steps 0 is out of range"),
    ({"num_inference_steps": 1}, "num_inference_steps 1 is too few for this pipeline's scheduler"),
    ({"negative_prompt": ["a", "b"]}, "negative_prompt has 2 rows, prompt 1"),
    ({"height": 4096, "width": 4096}, "over the largest image"),
])
def test_bad_requests_are_invalid_argument_and_the_server_serves_on(qwen_image, change, message):
    pipeline_dir, server = qwen_image
    with pytest.raises(InferenceServerException) as refused:
        served(server, "qwen-ring", {**REQUEST, **change})
    assert "INVALID_ARG" in str(refused.value.status()) and message in refused.value.message()
    assert served(server, "qwen-ring", REQUEST).shape == (1, 64, 48, 3)


# 48x48 is 9 image tokens: the ranks hold 5 and 4. diffusers' First Block Cache's ratios at steps 1 to 3 of this
# request (one process, both branches alike): 0.27, 0.42, 0.42 after a skip; 0.35 skips step 1 only, 10 every step
# after the first. Each threshold is far from every ratio, so a rank's float sums cannot tip a decision.
CACHED = {**REQUEST, "height": 48, "width": 48, "num_inference_steps": 4}
FIRST_BLOCK_FULL_STEPS = {0.35: 3, 10.0: 1}


@pytest.mark.parametrize("method", ("ulysses", "ring"))
def test_first_block_cache_equals_diffusers_with_the_same_config(qwen_image, method):
    """Every rank takes the one-process decision (the sums added across the ranks, whose shares differ), so the
    image equals diffusers' with the same FirstBlockCacheConfig, and full_steps counts the steps that ran every
    block; the large threshold changes the image; the next request without a cache runs every step, as before."""
    pipeline_dir, server = qwen_image
    model = f"qwen-{method}"
    for threshold, full_steps in FIRST_BLOCK_FULL_STEPS.items():
        image, ran = served_with_steps(server, model, CACHED, {"method": "first_block", "threshold": threshold})
        expected = reference(pipeline_dir, CACHED, cache=FirstBlockCacheConfig(threshold=threshold))
        assert max_level_difference(image, expected) <= 1 and ran == full_steps, threshold
    uncached = reference(pipeline_dir, CACHED)
    assert max_level_difference(expected, uncached) > 1
    image, ran = served_with_steps(server, model, CACHED)
    assert max_level_difference(image, uncached) <= 1 and ran == CACHED["num_inference_steps"]


def test_taylorseer_equals_diffusers_with_the_same_config(qwen_image):
    """TaylorSeer decides by the call count, alike on every rank: computed at steps 0 and 2, predicted at 1 and 3.
    Predicting the tiny transformer's attentions moves its image by one level at most (at 89 of its 6,912 values in
    one process): the served image must be diffusers' TaylorSeer image, not the uncached one."""
    pipeline_dir, server = qwen_image
    cache = {"method": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}
    image, ran = served_with_steps(server, "qwen-ulysses", CACHED, cache)
    expected = reference(pipeline_dir, CACHED, cache=TaylorSeerCacheConfig(cache_interval=2,
                                                                           disable_cache_before_step=1))
    assert max_level_difference(image, expected) <= 1 and ran == 2
    moved = np.count_nonzero(expected != reference(pipeline_dir, CACHED))
    assert moved > 40 and np.count_nonzero(image != expected) < moved // 4


@pytest.mark.parametrize("cache, message", [
    ({"method": "first_block", "threshold": -1}, "cache threshold -1 is not a finite number >= 0"),
    ({"method": "teacache"}, "cache method 'teacache' is not one of none, first_block, taylorseer"),
    ({"method": "first_block", "interval": 2}, "cache field(s) interval unknown to method 'first_block'"),
    ("[1]", "cache is an array, not a JSON object"),
])
def test_bad_caches_are_invalid_argument_and_the_server_serves_on(qwen_image, cache, message):
    _, server = qwen_image
    with pytest.raises(InferenceServerException) as refused:
        served_with_steps(server, "qwen-ring", CACHED, cache)
    assert "INVALID_ARG" in str(refused.value.status()) and message in refused.value.message()
    assert served(server, "qwen-ring", REQUEST).shape == (1, 64, 48, 3)


def test_plans_it_cannot_serve_are_refused_at_build(tmp_path):
    pipeline_dir = save_tiny_qwen_image_pipeline(tmp_path / "pipeline")
    with pytest.raises(EngineError, match="--tp 1"):
        build_model_version(tmp_path / "repository", "qwen", BuildRequest(
            "qwen-image-pipeline", None, ParallelPlan(tp_size=2), "FP32", "cpu", weights_path=pipeline_dir,
            progress=False))
    assert not (tmp_path / "repository" / "qwen").exists()


def test_every_rank_splits_the_transformer_by_its_plan(qwen_image):
    """The answers above come from the transformer split across both ranks (the method's log line of each)."""
    _, server = qwen_image
    log = server.log_file.read_text()
    for rank in (0, 1):
        for method in METHODS:
            assert (f"mdtriton rank {rank} worker: QwenImageTransformer2DModel split by its context-parallel plan "
                    f"across 2 ranks ({method})") in log


def test_mdtriton_generate_writes_the_image(qwen_image, tmp_path):
    """The CLI sends Qwen-Image's own inputs (negative prompt, --guidance as true_cfg_scale) and writes the PNG."""
    from mdtriton.cli import main

    pipeline_dir, server = qwen_image
    output = tmp_path / "cat.png"
    assert main(["generate", "qwen-ulysses", REQUEST["prompt"][0], "--url", server.grpc_address, "--height", "64",
                 "--width", "48", "--steps", "2", "--guidance", "4", "--seed", "7", "--negative-prompt",
                 REQUEST["negative_prompt"][0], "-o", str(output)]) == 0
    image = np.asarray(Image.open(output))[None]
    assert max_level_difference(image, reference(pipeline_dir, REQUEST)) <= 1


def test_mdtriton_generate_refuses_an_image_for_a_model_that_takes_none(qwen_image, tmp_path, capsys):
    from mdtriton.cli import main

    _, server = qwen_image
    Image.fromarray(np.zeros((64, 48, 3), np.uint8)).save(tmp_path / "in.png")
    assert main(["generate", "qwen-ring", "a cat", "--url", server.grpc_address, "--image", str(tmp_path / "in.png"),
                 "-o", str(tmp_path / "out.png")]) == 1
    assert "qwen-ring takes no input images (qwen-image-pipeline), not 1" in capsys.readouterr().err
    assert not (tmp_path / "out.png").exists()


KLEIN_METHODS = ("ulysses", "allgather_kv")
KLEIN_REQUEST = dict(prompt=["a red cat on a blue mat"], height=64, width=48, num_inference_steps=2, guidance_scale=4.0,
                     seed=3)


@pytest.fixture(scope="module")
def flux2_klein(tmp_path_factory):
    """The tiny FLUX.2 [klein] directory and a server of it built on 2 ranks by two methods."""
    pipeline_dir, server = served_pipeline(tmp_path_factory.mktemp("flux2-klein"), save_tiny_flux2_klein_pipeline,
                                           "flux2-klein-pipeline", KLEIN_METHODS, "klein")
    yield pipeline_dir, server
    server.stop()


@pytest.mark.parametrize("method", KLEIN_METHODS)
def test_flux2_klein_equals_diffusers_in_one_process(flux2_klein, method):
    pipeline_dir, server = flux2_klein
    image = served(server, f"klein-{method}", KLEIN_REQUEST)
    assert image.shape == (1, 64, 48, 3)
    assert max_level_difference(image, reference(pipeline_dir, KLEIN_REQUEST, Flux2KleinPipeline)) <= 1
    assert (f"mdtriton rank 1 worker: Flux2Transformer2DModel split by its context-parallel plan across 2 ranks "
            f"({method})") in server.log_file.read_text()


def test_flux2_klein_with_input_images_equals_diffusers(flux2_klein):
    """Reference images (a third of another size), which change the image, sent as image, image_2, image_3."""
    pipeline_dir, server = flux2_klein
    images = [np.asarray(Image.fromarray(np.random.default_rng(seed).integers(0, 256, (16, 12, 3), np.uint8)).resize(
        (64 + 16 * (seed == 2), 64))) for seed in range(3)]
    request = {**KLEIN_REQUEST, "images": images}
    image = served(server, "klein-allgather_kv", request)
    expected = reference(pipeline_dir, request, Flux2KleinPipeline)
    assert max_level_difference(image, expected) <= 1
    assert max_level_difference(expected, reference(pipeline_dir, KLEIN_REQUEST, Flux2KleinPipeline)) > 2


def test_flux2_klein_refuses_a_text_length_out_of_range(flux2_klein):
    _, server = flux2_klein
    with pytest.raises(InferenceServerException) as refused:
        served(server, "klein-ulysses", {**KLEIN_REQUEST, "max_sequence_length": 600})
    assert "max_sequence_length 600 is out of range; send 1 to 512" in refused.value.message()
    assert served(server, "klein-ulysses", KLEIN_REQUEST).shape == (1, 64, 48, 3)
