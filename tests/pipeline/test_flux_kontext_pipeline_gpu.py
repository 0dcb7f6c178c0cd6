"""FLUX.1 Kontext served through our FLUX engine on 2 GPUs (NCCL ranks, ulysses 2, BF16, compiled and warmed up as
the FLUX family is when served on GPUs): with an input image (its tokens appended to the sequence, an odd length split
unevenly) and without one, two requests at once (so that rank 1 receives one) and more in a row, each image equal to
the same pipeline served on one GPU within bf16 rounding (max and mean uint8 levels and PSNR printed)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.engine.manifest import EngineLimits
from mdtriton.engine.plan import ParallelPlan
from mdtriton.harness import psnr
from mdtriton.testing.tiny_flux_pipeline import tiny_flux_kontext_pipeline
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference, mean_level_difference
from tests.pipeline.test_flux_kontext_pipeline import REQUEST, input_image, served

pytestmark = pytest.mark.gpu
MODELS = {"kontext_1gpu": ParallelPlan(), "kontext_ulysses2": ParallelPlan(cp_size=2, cp_method="ulysses")}
IN_A_ROW = 6


@pytest.fixture(scope="module")
def kontext_on_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = tmp_path_factory.mktemp("kontext-gpu")
    pipeline_dir = root / "pipeline"
    tiny_flux_kontext_pipeline(seed=0).save_pretrained(pipeline_dir)
    for name, plan in MODELS.items():
        build_model_version(root / "repository", name, BuildRequest(
            "flux-kontext-pipeline", None, plan, "BF16", "gpu", progress=False, weights_path=pipeline_dir,
            limits=EngineLimits(max_batch_size=1, max_tokens=600)))
    server = start_server(root / "repository", root / "server.log")
    yield server
    server.stop()


@pytest.mark.timeout(300)
def test_kontext_on_2_gpus_equals_one_gpu_within_bf16_rounding(kontext_on_gpus):
    server = kontext_on_gpus
    cases = [(REQUEST, input_image()), (REQUEST, None), ({**REQUEST, "seed": 8}, input_image(48, 48))]
    expected = [served(server, "kontext_1gpu", request, image) for request, image in cases]
    assert expected[0].std() > 10  # a real picture
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda case: served(server, "kontext_ulysses2", *case), cases))
    got += [served(server, "kontext_ulysses2", *cases[i % len(cases)]) for i in range(IN_A_ROW)]
    for index, image in enumerate(got):
        want = expected[index % len(cases)]
        levels, mean, quality = max_level_difference(image, want), mean_level_difference(image, want), psnr(image, want)
        print(f"request {index}: max {levels}, mean {mean:.3f} uint8 levels, PSNR {quality:.1f} dB")
        # bf16 rounding, not a lost or misplaced token: FLUX.1-dev's size on 2 GPUs was 39.3 dB, a mean of 2.18 levels.
        assert mean <= 3.0 and quality >= 30.0, (index, levels, mean, quality)
