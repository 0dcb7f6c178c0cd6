"""Any diffusers pipeline (`diffusers-pipeline`, mdtriton.pipeline.any_pipeline) served on 2 GPUs, NCCL ranks: the
tiny WanPipeline by Ulysses, two requests at once (so that rank 1 receives one) and 10 in a row, each video equal to
diffusers' WanPipeline on one GPU within 1 uint8 level (float32)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.testing.tiny_wan_pipeline import save_tiny_wan_pipeline
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference
from tests.pipeline.test_any_pipeline import WAN, ask

pytestmark = pytest.mark.gpu
IN_A_ROW = 10


@pytest.fixture(scope="module")
def wan_on_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = tmp_path_factory.mktemp("any-pipeline-gpu")
    pipeline_dir = save_tiny_wan_pipeline(root / "wan")
    build_model_version(root / "repository", "wan", BuildRequest(
        "diffusers-pipeline", None, ParallelPlan(cp_size=2, cp_method="ulysses"), "FP32", "gpu", gpus=[0, 1],
        weights_path=pipeline_dir, progress=False))
    server = start_server(root / "repository", root / "server.log")
    yield pipeline_dir, server
    server.stop()


def one_gpu(pipeline_dir) -> np.ndarray:
    pipeline = WanPipeline.from_pretrained(pipeline_dir, local_files_only=True).to("cuda:0")
    pipeline.set_progress_bar_config(disable=True)
    arguments = {key: value for key, value in WAN.items() if key != "seed"}
    frames = pipeline(**arguments, generator=torch.Generator().manual_seed(WAN["seed"]), output_type="np").frames
    return (frames * 255).round().astype(np.uint8)


def test_served_on_2_gpus_equals_one_gpu(wan_on_gpus):
    pipeline_dir, server = wan_on_gpus
    expected = one_gpu(pipeline_dir)
    with ThreadPoolExecutor(2) as pool:
        at_once = list(pool.map(lambda _: ask(server, "wan", WAN, "video"), range(2)))
    assert max(max_level_difference(video, expected) for video in at_once) <= 1
    for _ in range(IN_A_ROW):
        assert max_level_difference(ask(server, "wan", WAN, "video"), expected) <= 1
