"""Pipelines with input images served with diffusers' own transformer split by its plan on 2 GPUs, NCCL ranks: the
tiny FLUX.2 [dev] with three reference images (ulysses, ring) and the tiny Qwen-Image-Edit-Plus with one and three
input images (ulysses), each equal to its diffusers pipeline on one GPU within 1 uint8 level (float32); two requests
at once and a few in a row."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline, QwenImageEditPlusPipeline
from PIL import Image

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.image_text_processor import image_text_processor
from mdtriton.testing.tiny_flux2_pipeline import save_tiny_flux2_pipeline
from mdtriton.testing.tiny_qwen_image_pipeline import save_tiny_qwen_image_edit_plus_pipeline
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference
from tests.pipeline.test_diffusers_pipelines import served
from tests.pipeline.test_image_pipelines import DEV_REQUEST, EDIT_REQUEST, IMAGES

pytestmark = pytest.mark.gpu
IN_A_ROW = 5
# (model name, architecture, method)
MODELS = (("dev-ulysses", "flux2-pipeline", "ulysses"), ("dev-ring", "flux2-pipeline", "ring"),
          ("edit-ulysses", "qwen-image-edit-plus-pipeline", "ulysses"))


@pytest.fixture(scope="module")
def image_pipelines_on_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = tmp_path_factory.mktemp("image-pipelines-gpu")
    directories = {"flux2-pipeline": save_tiny_flux2_pipeline(root / "flux2"),
                   "qwen-image-edit-plus-pipeline": save_tiny_qwen_image_edit_plus_pipeline(root / "edit-plus")}
    for name, architecture, method in MODELS:
        build_model_version(root / "repository", name, BuildRequest(
            architecture, None, ParallelPlan(cp_size=2, cp_method=method), "FP32", "gpu", gpus=[0, 1],
            weights_path=directories[architecture], progress=False))
    server = start_server(root / "repository", root / "server.log")
    yield directories, server
    server.stop()


def one_gpu(pipeline, request: dict) -> np.ndarray:
    """The pipeline's image on GPU 0 for a request as `served` takes it."""
    arguments = {key: value for key, value in request.items() if key not in ("seed", "images")}
    arguments["image"] = [Image.fromarray(image) for image in request["images"]]
    images = pipeline(**arguments, generator=torch.Generator().manual_seed(request["seed"]), output_type="np").images
    return (images * 255).round().astype(np.uint8)


def check_served(server, model: str, request: dict, expected: np.ndarray) -> None:
    with ThreadPoolExecutor(2) as pool:
        at_once = list(pool.map(lambda _: served(server, model, request), range(2)))
    assert max(max_level_difference(image, expected) for image in at_once) <= 1
    for _ in range(IN_A_ROW):
        assert max_level_difference(served(server, model, request), expected) <= 1


@pytest.mark.parametrize("method", ("ulysses", "ring"))
def test_flux2_dev_with_three_images_on_2_gpus_equals_one_gpu(image_pipelines_on_gpus, method):
    directories, server = image_pipelines_on_gpus
    pipeline = Flux2Pipeline.from_pretrained(directories["flux2-pipeline"], local_files_only=True).to("cuda:0")
    pipeline.set_progress_bar_config(disable=True)
    request = {**DEV_REQUEST, "images": IMAGES}
    check_served(server, f"dev-{method}", request, one_gpu(pipeline, request))


@pytest.mark.parametrize("count", (1, 3))
def test_edit_plus_on_2_gpus_equals_one_gpu(image_pipelines_on_gpus, count):
    directories, server = image_pipelines_on_gpus
    pipeline_dir = directories["qwen-image-edit-plus-pipeline"]
    pipeline = QwenImageEditPlusPipeline.from_pretrained(pipeline_dir, local_files_only=True,
                                                         processor=image_text_processor(pipeline_dir)).to("cuda:0")
    pipeline.set_progress_bar_config(disable=True)
    request = {**EDIT_REQUEST, "images": IMAGES[:count]}
    check_served(server, "edit-ulysses", request, one_gpu(pipeline, request))
