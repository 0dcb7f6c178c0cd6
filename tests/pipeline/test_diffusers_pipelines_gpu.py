"""Qwen-Image served with diffusers' own transformer split by its plan (mdtriton.pipeline.generic) on 2 GPUs, NCCL
ranks, each method and guidance parallelism, its repeated blocks compiled and its forwards replayed from CUDA graphs
(as every GPU rank runs it): two requests sent at once (so that rank 1 receives one), a batch of two prompts of
different lengths (the text mask gathered with the keys: run without graphs) and 20 in a row, each image equal to
diffusers' QwenImagePipeline on one GPU (eager) within 1 uint8 level (float32)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.testing.tiny_qwen_image_pipeline import save_tiny_qwen_image_pipeline
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference
from tests.pipeline.test_diffusers_pipelines import served

pytestmark = pytest.mark.gpu
METHODS = ("ulysses", "ring", "allgather_kv")
PLANS = {**{method: ParallelPlan(cp_size=2, cp_method=method) for method in METHODS}, "cfg": ParallelPlan(cfg_size=2)}
REQUEST = dict(prompt=["a red cat on a blue mat"], negative_prompt=["blurry"], height=64, width=48,
               num_inference_steps=2, true_cfg_scale=4.0, seed=7)
BATCH = {**REQUEST, "prompt": ["a cat", "a red cat on a blue mat in the sun"], "negative_prompt": ["blurry", "dark"]}
IN_A_ROW = 20


@pytest.fixture(scope="module")
def qwen_image_on_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = tmp_path_factory.mktemp("qwen-image-gpu")
    pipeline_dir = save_tiny_qwen_image_pipeline(root / "pipeline")
    for name, plan in PLANS.items():
        build_model_version(root / "repository", f"qwen-{name}", BuildRequest(
            "qwen-image-pipeline", None, plan, "FP32", "gpu", gpus=[0, 1], weights_path=pipeline_dir, progress=False))
    server = start_server(root / "repository", root / "server.log")
    yield pipeline_dir, server
    server.stop()


def one_gpu(pipeline_dir, request: dict) -> np.ndarray:
    pipeline = QwenImagePipeline.from_pretrained(pipeline_dir, local_files_only=True).to("cuda:0")
    pipeline.set_progress_bar_config(disable=True)
    arguments = {key: value for key, value in request.items() if key != "seed"}
    images = pipeline(**arguments, generator=torch.Generator().manual_seed(request["seed"]), output_type="np").images
    return (images * 255).round().astype(np.uint8)


@pytest.mark.parametrize("plan", PLANS)
def test_served_on_2_gpus_equals_one_gpu(qwen_image_on_gpus, plan):
    pipeline_dir, server = qwen_image_on_gpus
    model = f"qwen-{plan}"
    expected, expected_batch = one_gpu(pipeline_dir, REQUEST), one_gpu(pipeline_dir, BATCH)
    with ThreadPoolExecutor(2) as pool:
        at_once = list(pool.map(lambda _: served(server, model, REQUEST), range(2)))
    assert max(max_level_difference(image, expected) for image in at_once) <= 1
    assert max_level_difference(served(server, model, BATCH), expected_batch) <= 1
    for _ in range(IN_A_ROW):
        assert max_level_difference(served(server, model, REQUEST), expected) <= 1


def test_every_rank_compiled_the_blocks(qwen_image_on_gpus):
    """The images above came from compiled blocks replayed as CUDA graphs, and guidance split its branches."""
    _, server = qwen_image_on_gpus
    log = server.log_file.read_text()
    for rank in (0, 1):
        assert (f"mdtriton rank {rank} worker: QwenImageTransformer2DModel: its repeated blocks compiled "
                "(QwenImageTransformerBlock)") in log
        assert (f"mdtriton rank {rank} worker: QwenImageTransformer2DModel replays CUDA graphs of its forwards") in log
    assert "this rank runs the unconditional branch" in log
