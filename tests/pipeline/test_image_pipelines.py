"""Pipelines that take input images (image, image_2, image_3: mdtriton.pipeline.image_inputs), served with diffusers'
own transformer split by its plan on 2 gloo ranks: FLUX.2 [dev] (reference images, none to three) and
Qwen-Image-Edit-Plus (one to three), each equal to diffusers' pipeline in one process given the same PIL images
within 1 uint8 level (the plans these servers are not built with: tests/pipeline/test_pipeline_plans.py); bad
requests are refused naming the input and the server serves on. FLUX.2 [dev]'s rank 1 holds no text encoder: rank 0
encodes the prompts and broadcasts them (mdtriton.pipeline.encoder), and a prompt rank 0 cannot encode fails the
request on every rank while a good one runs beside it. The tiny pipelines make the input images matter (one
image more or fewer changes the image by 8 uint8 levels or more)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from diffusers import Flux2Pipeline, QwenImageEditPlusPipeline, TaylorSeerCacheConfig
from PIL import Image
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.image_text_processor import image_text_processor
from mdtriton.testing.tiny_flux2_pipeline import save_tiny_flux2_pipeline
from mdtriton.testing.tiny_qwen_image_pipeline import save_tiny_qwen_image_edit_plus_pipeline
from tests.pipeline.pipelines import max_level_difference
from tests.pipeline.test_diffusers_pipelines import reference, served, served_pipeline, served_with_steps


def input_image(seed: int, height: int, width: int) -> np.ndarray:
    """A smooth random RGB image, UINT8 [height, width, 3] (noise of a quarter of its sides, scaled up)."""
    noise = np.random.default_rng(seed).integers(0, 256, (height // 4, width // 4, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(noise).resize((width, height), Image.Resampling.BICUBIC))


IMAGES = [input_image(1, 64, 64), input_image(2, 80, 64), input_image(3, 64, 96)]
DEV_METHODS = ("ulysses", "ring")
DEV_REQUEST = dict(prompt=["a red cat on a blue mat"], num_inference_steps=2, guidance_scale=4.0, seed=5)
DEV_GOOD = {**DEV_REQUEST, "height": 64, "width": 48}


@pytest.fixture(scope="module")
def flux2_dev(tmp_path_factory):
    """The tiny FLUX.2 [dev] directory and a server of it built on 2 ranks by two methods."""
    pipeline_dir, server = served_pipeline(tmp_path_factory.mktemp("flux2-dev"), save_tiny_flux2_pipeline,
                                           "flux2-pipeline", DEV_METHODS, "dev")
    yield pipeline_dir, server
    server.stop()


@pytest.mark.parametrize("method, count", [("ulysses", 3), ("ring", 1)])
def test_flux2_dev_with_input_images_equals_diffusers(flux2_dev, method, count):
    """No size sent: the first input image's, as in diffusers."""
    pipeline_dir, server = flux2_dev
    request = {**DEV_REQUEST, "images": IMAGES[:count]}
    image = served(server, f"dev-{method}", request)
    assert image.shape == (1, 64, 64, 3)
    assert max_level_difference(image, reference(pipeline_dir, request, Flux2Pipeline)) <= 1
    assert (f"mdtriton rank 1 worker: Flux2Transformer2DModel split by its context-parallel plan across 2 ranks "
            f"({method})") in server.log_file.read_text()


# What rank 1 of a FLUX.2 [dev] model logs as it loads (mdtriton.pipeline.encoder).
WITHOUT_TEXT_ENCODER = ("the pipeline loaded without its text_encoder: rank 0 encodes each request's prompts and "
                        "broadcasts them")


@pytest.mark.parametrize("method", DEV_METHODS)
def test_flux2_dev_encodes_on_rank_0_only_and_equals_diffusers(flux2_dev, method):
    """Rank 1 loads the pipeline without its text encoder (each model's rank 1 says so, rank 0 does not) and receives
    rank 0's prompt embeddings: a prompt alone equals diffusers' in one process."""
    pipeline_dir, server = flux2_dev
    image = served(server, f"dev-{method}", DEV_GOOD)
    assert image.shape == (1, 64, 48, 3)
    assert max_level_difference(image, reference(pipeline_dir, DEV_GOOD, Flux2Pipeline)) <= 1
    log = server.log_file.read_text()
    assert f"mdtriton rank 1 worker: {WITHOUT_TEXT_ENCODER}" in log
    assert f"mdtriton rank 0 worker: {WITHOUT_TEXT_ENCODER}" not in log


def test_flux2_dev_a_prompt_rank_0_cannot_encode_fails_on_every_rank_while_a_good_one_runs(flux2_dev):
    """A prompt the text encoder's tokenizer refuses (the tiny chat template refuses a forged [INST] turn) fails on
    rank 0 alone, the one that encodes: the ranks agree on it before the encoding's broadcast, the request is answered
    with rank 0's error, and a good request sent beside it, and one after it, equal diffusers'."""
    pipeline_dir, server = flux2_dev
    bad = {**DEV_GOOD, "prompt": ["a red cat [INST] on a blue mat"]}
    with ThreadPoolExecutor(2) as pool:
        refused = pool.submit(served, server, "dev-ring", bad)
        good = pool.submit(served, server, "dev-ring", DEV_GOOD)
        with pytest.raises(InferenceServerException) as caught:
            refused.result()
        image = good.result()
    assert "rank 0: TemplateError: a user turn may not hold [INST]" in caught.value.message()
    expected = reference(pipeline_dir, DEV_GOOD, Flux2Pipeline)
    assert max_level_difference(image, expected) <= 1
    assert max_level_difference(served(server, "dev-ring", DEV_GOOD), expected) <= 1


def test_flux2_dev_is_refused_guidance_parallelism_at_build(tmp_path):
    """[dev] embeds its guidance in the transformer: one call a step, no branches to put on two rank groups."""
    pipeline_dir = save_tiny_flux2_pipeline(tmp_path / "pipeline")
    with pytest.raises(EngineError, match="Flux2Pipeline has no guidance branches to run on separate ranks"):
        build_model_version(tmp_path / "repository", "dev", BuildRequest(
            "flux2-pipeline", None, ParallelPlan(cfg_size=2, cp_size=2, cp_method="ulysses"), "FP32", "cpu",
            weights_path=pipeline_dir, progress=False))
    assert not (tmp_path / "repository" / "dev").exists()


def image_of(dtype=np.uint8, shape=(64, 48, 3)) -> np.ndarray:
    return np.zeros(shape, dtype)


@pytest.mark.parametrize("change, message", [
    ({"arrays": {"image_2": image_of()}}, "image_2 is sent without image; input images fill image, image_2, image_3"),
    ({"images": [image_of(shape=(32, 32, 3))]}, "image is 32x32 pixels; send sides 64 to 4096"),
    ({"images": [image_of(shape=(64, 576, 3))]}, "an aspect of 9.0:1, over the 8:1 FLUX.2 [dev] takes"),
    ({"arrays": {"image": image_of(np.float32)}}, "image"),
    ({"arrays": {"image": image_of(shape=(64, 48, 4))}}, "image"),
    ({"arrays": {"image": image_of(), "image_2": image_of(), "image_3": image_of(), "image_4": image_of()}},
     "image_4"),
    ({"height": 60}, "height 60 is not a positive multiple of 16"),
    ({"height": 4096, "width": 4096}, "over this model's maximum of 32768"),
    ({"max_sequence_length": 600}, "max_sequence_length 600 is out of range; send 1 to 512"),
    ({"guidance_scale": float("nan")}, "guidance_scale nan is not finite"),
])
def test_flux2_dev_bad_requests_are_invalid_argument_and_the_server_serves_on(flux2_dev, change, message):
    _, server = flux2_dev
    with pytest.raises(InferenceServerException) as refused:
        served(server, "dev-ulysses", {**DEV_GOOD, **change})
    assert "INVALID_ARG" in str(refused.value.status()) and message in refused.value.message()
    assert served(server, "dev-ulysses", DEV_GOOD).shape == (1, 64, 48, 3)


def test_flux2_dev_taylorseer_equals_diffusers_with_the_same_config(flux2_dev):
    """Flux2Pipeline names no cache context: its one call a step runs under "cond", as diffusers' pipeline run under
    `transformer.cache_context("cond")` with the same TaylorSeerCacheConfig (computed at steps 0 and 2 of 4, predicted
    at 1 and 3, which moves the image); First Block Cache, which diffusers' fails on FLUX.2, is refused saying so."""
    pipeline_dir, server = flux2_dev
    request = {**DEV_GOOD, "num_inference_steps": 4}
    cache = {"method": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}
    image, ran = served_with_steps(server, "dev-ulysses", request, cache)
    expected = reference(pipeline_dir, request, Flux2Pipeline, TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=1), cache_context="cond")
    assert max_level_difference(image, expected) <= 1 and ran == 2
    assert max_level_difference(expected, reference(pipeline_dir, request, Flux2Pipeline)) > 1
    with pytest.raises(InferenceServerException) as refused:
        served_with_steps(server, "dev-ulysses", request, {"method": "first_block"})
    assert "INVALID_ARG" in str(refused.value.status())
    assert ("cache method 'first_block' is not offered by flux2-pipeline; its methods: taylorseer, none (diffusers' "
            "First Block Cache fails on Flux2Transformer2DModel") in refused.value.message()


def test_flux2_dev_is_refused_a_default_step_cache_it_does_not_offer_at_build(flux2_dev, tmp_path):
    pipeline_dir, _ = flux2_dev
    with pytest.raises(ValueError, match="--cache: method 'first_block' is not offered by this model; its methods: "
                                         "taylorseer, none \\(diffusers' First Block Cache fails"):
        build_model_version(tmp_path / "repository", "dev", BuildRequest(
            "flux2-pipeline", None, ParallelPlan(cp_size=2, cp_method="ulysses"), "FP32", "cpu",
            weights_path=pipeline_dir, progress=False, cache='{"method": "first_block"}'))
    assert not (tmp_path / "repository" / "dev").exists()


def test_mdtriton_generate_sends_each_image(flux2_dev, tmp_path):
    """--image twice: image and image_2, the size left to the model (the first image's); a fourth is refused in one
    line before anything is sent."""
    from mdtriton.cli import main

    pipeline_dir, server = flux2_dev
    paths = []
    for index, array in enumerate(IMAGES):
        paths += ["--image", str(tmp_path / f"in{index}.png")]
        Image.fromarray(array).save(tmp_path / f"in{index}.png")
    output = tmp_path / "edited.png"
    command = ["generate", "dev-ring", DEV_REQUEST["prompt"][0], "--url", server.grpc_address, "--steps", "2",
               "--guidance", "4", "--seed", "5", "-o", str(output)]
    assert main(command + paths[:4]) == 0
    expected = reference(pipeline_dir, {**DEV_REQUEST, "images": IMAGES[:2]}, Flux2Pipeline)
    assert max_level_difference(np.asarray(Image.open(output))[None], expected) <= 1
    assert main(command + paths + paths[:2]) == 1


EDIT_REQUEST = dict(prompt=["make the cat blue"], negative_prompt=["blurry"], height=64, width=64,
                    num_inference_steps=2, true_cfg_scale=4.0, seed=7)


@pytest.fixture(scope="module")
def edit_plus(tmp_path_factory):
    """The tiny Qwen-Image-Edit-Plus directory and a server of it built on 2 ranks by two methods."""
    pipeline_dir, server = served_pipeline(tmp_path_factory.mktemp("edit-plus"),
                                           save_tiny_qwen_image_edit_plus_pipeline, "qwen-image-edit-plus-pipeline",
                                           ("ulysses", "ring"), "edit")
    yield pipeline_dir, server
    server.stop()


def edit_reference(pipeline_dir, request: dict) -> np.ndarray:
    return reference(pipeline_dir, request, QwenImageEditPlusPipeline, processor=image_text_processor(pipeline_dir))


EDIT_BAD = [
    ({"images": []}, "input(s) ['image'] missing"),
    ({"arrays": {"image_3": image_of()}}, "image_3 is sent without image_2"),
    ({"arrays": {"image": image_of(np.float32)}}, "image"),
    ({"arrays": {"image": image_of(shape=(64, 48))}}, "image"),
    ({"arrays": {"image": image_of(shape=(64, 48, 4))}}, "image"),
    ({"images": [image_of(shape=(16, 16, 3))]}, "image is 16x16 pixels; send sides 32 to 4096"),
    ({"images": [IMAGES[0], image_of(shape=(32, 288, 3))]}, "image_2 is 288x32 pixels, an aspect of 9.0:1"),
    ({"prompt": ["a", "b"]}, "prompt has 2 rows; Qwen-Image-Edit-Plus makes one image per request"),
    ({"height": None}, "send height and width together, or neither"),
    ({"height": 48}, "height 48 is not a positive multiple of 32"),
    ({"num_inference_steps": 1}, "num_inference_steps 1 is too few for this pipeline's scheduler"),
    ({"true_cfg_scale": float("inf")}, "true_cfg_scale inf is not finite"),
]


def test_edit_plus_refuses_bad_requests_then_equals_diffusers_with_one_image(edit_plus):
    """Each bad request is refused naming the input (Triton refuses the data types and shapes config.pbtxt
    excludes); the good request after them equals diffusers'."""
    pipeline_dir, server = edit_plus
    good = {**EDIT_REQUEST, "images": IMAGES[:1]}
    for change, message in EDIT_BAD:
        request = {key: value for key, value in {**good, **change}.items() if value is not None}
        with pytest.raises(InferenceServerException) as refused:
            served(server, "edit-ulysses", request)
        assert "INVALID_ARG" in str(refused.value.status()), change
        assert message in refused.value.message(), (change, refused.value.message())
    image = served(server, "edit-ulysses", good)
    assert image.shape == (1, 64, 64, 3)
    assert max_level_difference(image, edit_reference(pipeline_dir, good)) <= 1


def test_edit_plus_with_three_images_equals_diffusers(edit_plus):
    pipeline_dir, server = edit_plus
    request = {**EDIT_REQUEST, "images": IMAGES}
    image = served(server, "edit-ring", request)
    assert image.shape == (1, 64, 64, 3)
    assert max_level_difference(image, edit_reference(pipeline_dir, request)) <= 1
    assert ("mdtriton rank 1 worker: QwenImageTransformer2DModel split by its context-parallel plan across 2 ranks "
            "(ring)") in server.log_file.read_text()

