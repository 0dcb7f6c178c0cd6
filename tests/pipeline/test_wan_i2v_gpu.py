"""Wan 2.1 image to video (wan-i2v-pipeline: its image encoder's tokens beside the text and the image's latents
beside the noise) served on one GPU and on 2 GPUs (NCCL ranks) with ulysses 2, tp 2 and cfg 2, float32 as the other
served-pipeline GPU tests: two requests at once (so that both ranks receive one), each clip within 2 uint8 levels of
the one-GPU clip (the plans add and reduce in other orders)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.pipeline import generate_video
from mdtriton.engine.manifest import EngineLimits
from mdtriton.engine.plan import ParallelPlan
from mdtriton.testing.tiny_wan_pipeline import save_tiny_wan_i2v_pipeline, sample_image
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference

pytestmark = pytest.mark.gpu
PLANS = {"i2v_1gpu": ParallelPlan(), "i2v_ulysses2": ParallelPlan(cp_size=2, cp_method="ulysses"),
         "i2v_tp2": ParallelPlan(tp_size=2), "i2v_cfg2": ParallelPlan(cfg_size=2)}
CLIP = dict(height=32, width=48, num_frames=9, num_inference_steps=3, guidance_scale=5.0)
IMAGE = sample_image(40, 56, seed=1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("ftfy", reason="diffusers' WanImageToVideoPipeline cleans prompts with ftfy")
    root = tmp_path_factory.mktemp("wan_i2v_gpu")
    weights = save_tiny_wan_i2v_pipeline(root / "wan-i2v", "wan2.1-i2v", seed=1)
    for name, plan in PLANS.items():
        build_model_version(root / "repository", name, BuildRequest(
            "wan-i2v-pipeline", None, plan, "FP32", "gpu", progress=False, weights_path=weights,
            limits=EngineLimits(max_batch_size=1, max_tokens=600)))
    server = start_server(root / "repository", root / "server.log")
    yield server
    server.stop()


@pytest.mark.timeout(300)
def test_two_gpus_equal_one_gpu(served):
    def clips(model: str) -> list:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda seed: generate_video(served.grpc_address, model, "a red cat", **CLIP,
                                                             seed=seed, image=IMAGE, timeout=240), (3, 4)))

    expected = clips("i2v_1gpu")
    assert expected[0].std() > 10  # a real clip
    for model in [name for name in PLANS if name != "i2v_1gpu"]:
        for seed, (clip, want) in enumerate(zip(clips(model), expected)):
            assert max_level_difference(clip, want) <= 2, (model, seed)
