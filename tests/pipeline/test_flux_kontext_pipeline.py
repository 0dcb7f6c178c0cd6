"""FLUX.1 Kontext served both ways on 2 gloo ranks: through our FLUX engine (flux-kontext-pipeline: ulysses, ring, tp)
and with diffusers' own transformer split by its plan (flux-kontext-generic-pipeline: ulysses, ring); allgather_kv and
cfg 2 x ulysses 2 both ways: tests/pipeline/test_pipeline_plans.py. Each equals
diffusers' FluxKontextPipeline in one process with the same components, input image and seed within 1 uint8 level,
with an input image (its tokens appended to the sequence) and without one (text to image); the sequences' lengths are
odd, so the context-parallel ranks split them unevenly. Bad requests are refused with INVALID_ARGUMENT naming the
input, and the server serves on."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from diffusers import FirstBlockCacheConfig, FluxKontextPipeline, TaylorSeerCacheConfig
from PIL import Image
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.pipeline import infer_inputs, request_arrays
from mdtriton.engine.manifest import EngineLimits
from mdtriton.engine.plan import ParallelPlan
from mdtriton.testing.tiny_flux_pipeline import tiny_flux_kontext_pipeline
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference

MODELS = {
    "fast-ulysses": ("flux-kontext-pipeline", ParallelPlan(cp_size=2, cp_method="ulysses")),
    "fast-ring": ("flux-kontext-pipeline", ParallelPlan(cp_size=2, cp_method="ring")),
    "fast-tp": ("flux-kontext-pipeline", ParallelPlan(tp_size=2)),
    "generic-ulysses": ("flux-kontext-generic-pipeline", ParallelPlan(cp_size=2, cp_method="ulysses")),
    "generic-ring": ("flux-kontext-generic-pipeline", ParallelPlan(cp_size=2, cp_method="ring")),
}
LIMITS = EngineLimits(max_batch_size=2, max_tokens=300)
# 9 text tokens, 3x2 image tokens made and 2x4 of the input image: 23 tokens (15 without the image), split 12 + 11.
REQUEST = dict(prompt=["a red cat on a blue sign"], height=48, width=32, num_inference_steps=2, guidance_scale=3.5,
               seed=7, max_sequence_length=9)


def input_image(rows: int = 32, columns: int = 64) -> np.ndarray:
    """A smooth RGB picture, UINT8 [rows, columns, 3]."""
    y, x = np.mgrid[0:rows, 0:columns]
    return np.stack((x * 255 // columns, y * 255 // rows, (x + y) * 255 // (rows + columns)), axis=2).astype(np.uint8)


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    """The tiny Kontext directory and a server of it built each way on 2 ranks."""
    root = tmp_path_factory.mktemp("kontext")
    pipeline_dir = root / "pipeline"
    tiny_flux_kontext_pipeline(seed=0).save_pretrained(pipeline_dir)
    for name, (architecture, plan) in MODELS.items():
        build_model_version(root / "repository", name, BuildRequest(
            architecture, None, plan, "FP32", "cpu", weights_path=pipeline_dir, progress=False, limits=LIMITS))
    server = start_server(root / "repository", root / "server.log")
    yield pipeline_dir, server
    server.stop()


def reference(pipeline_dir, request: dict, image: np.ndarray | None, cache=None) -> np.ndarray:
    """diffusers' FluxKontextPipeline in one process: the input image at its size, the image made at height x width;
    with a diffusers cache config, after `transformer.enable_cache(cache)`, each transformer call under a cache context
    (the pipeline names none): "cond" for an unguided step's one call, "cond" then "uncond" for a guided step's two."""
    pipeline = FluxKontextPipeline.from_pretrained(pipeline_dir, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    arguments = {key: value for key, value in request.items() if key != "seed"}
    if image is not None:
        arguments.update(image=Image.fromarray(image), _auto_resize=False)
    if cache is not None:
        pipeline.transformer.enable_cache(cache)
        guided = request.get("negative_prompt") is not None and request.get("true_cfg_scale", 1.0) > 1
        names = ("cond", "uncond") if guided else ("cond",)
        calls, forward = itertools.count(), pipeline.transformer.forward

        def named_forward(*args, **kwargs):
            with pipeline.transformer.cache_context(names[next(calls) % len(names)]):
                return forward(*args, **kwargs)

        pipeline.transformer.forward = named_forward
    images = pipeline(**arguments, max_area=request["height"] * request["width"],
                      generator=torch.Generator().manual_seed(request["seed"]), output_type="np").images
    return (images * 255).round().astype(np.uint8)


def served(server, model: str, request: dict, image: np.ndarray | None) -> np.ndarray:
    return served_with_steps(server, model, request, image)[0]


def served_with_steps(server, model: str, request: dict, image: np.ndarray | None,
                      cache: dict | None = None) -> tuple[np.ndarray, int]:
    """The served image of a request with a step cache (None: none), and its full_steps."""
    texts = {name: request.get(name) for name in ("prompt", "negative_prompt")}
    numbers = {name: value for name, value in request.items() if name not in texts}
    arrays = request_arrays(texts, numbers, cache, None)
    if image is not None:
        arrays["image"] = image
    with grpcclient.InferenceServerClient(server.grpc_address) as client:
        result = client.infer(model, infer_inputs(arrays), client_timeout=300)
    return result.as_numpy("image"), int(result.as_numpy("full_steps")[0])


@pytest.mark.parametrize("model", MODELS)
def test_each_way_and_plan_equals_diffusers_with_and_without_an_input_image(kontext, model):
    pipeline_dir, server = kontext
    for image in (input_image(), None):
        made = served(server, model, REQUEST, image)
        assert made.shape == (1, 48, 32, 3)
        assert max_level_difference(made, reference(pipeline_dir, REQUEST, image)) <= 1, f"image given: {image is not None}"


def test_true_guidance_with_a_negative_prompt_and_the_input_image_s_size_by_default(kontext):
    """Kontext's true classifier-free guidance (a negative prompt, true_cfg_scale over 1) runs as diffusers runs it;
    a request without height and width makes an image of the input image's size."""
    pipeline_dir, server = kontext
    request = {**REQUEST, "negative_prompt": ["blurry"], "true_cfg_scale": 2.0}
    made = served(server, "fast-ulysses", request, input_image())
    assert max_level_difference(made, reference(pipeline_dir, request, input_image())) <= 1
    sized = {key: value for key, value in REQUEST.items() if key not in ("height", "width")}
    made = served(server, "generic-ring", sized, input_image())
    assert max_level_difference(made, reference(pipeline_dir, {**sized, "height": 32, "width": 64}, input_image())) <= 1


CACHED = {**REQUEST, "num_inference_steps": 4}
GUIDED_CACHED = {**CACHED, "negative_prompt": ["blurry"], "true_cfg_scale": 2.0}
TAYLORSEER = {"method": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}


@pytest.mark.parametrize("request_, cache, config, full_steps", [
    (CACHED, {"method": "first_block", "threshold": 0.5}, FirstBlockCacheConfig(threshold=0.5), 3),
    (GUIDED_CACHED, TAYLORSEER, TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1), 2),
], ids=["first_block", "guided-taylorseer"])
def test_generic_step_cache_equals_diffusers_with_the_same_config(kontext, request_, cache, config, full_steps):
    """FluxKontextPipeline names no cache context: an unguided step's one call runs under "cond", a guided step's
    under "cond" then "uncond", as diffusers' pipeline with its calls so named and the same cache config. The tiny
    pipeline's First Block Cache ratios at steps 1 to 3 of 4: 0.43, then 0.59 and 0.69 after the skip; 0.5 skips step
    1 only, far from each (a rank's float sums cannot tip a decision). TaylorSeer computes at steps 0 and 2 of each
    branch: one context for both branches would count each step twice."""
    pipeline_dir, server = kontext
    image, ran = served_with_steps(server, "generic-ulysses", request_, None, cache)
    expected = reference(pipeline_dir, request_, None, config)
    assert max_level_difference(image, expected) <= 1 and ran == full_steps
    assert max_level_difference(expected, reference(pipeline_dir, request_, None)) > 1


@pytest.mark.parametrize("change, image, message", [
    # Triton's own checks of the declared data type and shape, naming the input.
    ({}, input_image().astype(np.float32), "expects 'UINT8'"),
    ({}, input_image()[:, :, 0], "unexpected shape for input 'image'"),  # rank 2
    ({}, np.concatenate((input_image(), input_image()[:, :, :1]), axis=2), "unexpected shape for input 'image'"),
    ({}, np.stack((input_image(), input_image())), "unexpected shape for input 'image'"),  # two: Kontext edits one
    ({}, input_image(8, 64), "image is 64x8 pixels; send sides 16 to 4096"),
    ({}, input_image(16, 4112), "image is 4112x16 pixels; send sides 16 to 4096"),
    ({"height": 40}, input_image(), "height 40 is not a multiple of 16"),
    ({"height": 320, "width": 320}, input_image(), "is 417 tokens, over this model's maximum of 300"),
    ({"negative_prompt": ["a", "b"]}, input_image(), "negative_prompt has 2 rows, prompt 1"),
    ({"guidance_scale": float("nan")}, input_image(), "guidance_scale nan is not finite"),
    ({"true_cfg_scale": -1.0}, None, "true_cfg_scale -1 is out of range"),
    ({"num_inference_steps": 0}, None, "num_inference_steps 0 is out of range"),
])
def test_bad_requests_are_invalid_argument_and_the_server_serves_on(kontext, change, image, message):
    _, server = kontext
    with pytest.raises(InferenceServerException) as refused:
        served(server, "fast-ring", {**REQUEST, **change}, image)
    assert "INVALID_ARG" in str(refused.value.status()) and message in refused.value.message()
    assert served(server, "fast-ring", REQUEST, input_image()).shape == (1, 48, 32, 3)


def test_mdtriton_generate_sends_the_input_image(kontext, tmp_path):
    """`mdtriton generate --image` reads a PNG and sends it as Kontext's image; --guidance is its guidance_scale."""
    from mdtriton.cli import main

    pipeline_dir, server = kontext
    Image.fromarray(input_image()).save(tmp_path / "in.png")
    output = tmp_path / "out.png"
    assert main(["generate", "generic-ulysses", REQUEST["prompt"][0], "--url", server.grpc_address, "--image",
                 str(tmp_path / "in.png"), "--height", "48", "--width", "32", "--steps", "2", "--guidance", "3.5",
                 "--seed", "7", "--max-sequence-length", "9", "-o", str(output)]) == 0
    made = np.asarray(Image.open(output))[None]
    assert max_level_difference(made, reference(pipeline_dir, REQUEST, input_image())) <= 1
