"""LoRA adapters on Wan pipelines against diffusers' WanPipeline with `load_lora_weights` + `set_adapters`: Wan 2.1 on
one rank and split by tensor and by context parallelism, and Wan 2.2 A14B, whose adapters change its first expert
(`transformer`) only, as diffusers' loader does by default. The video equals diffusers' within one level, and a
request without adapters after them gets exactly the base video."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from mdtriton.build_tools.adapters import add_adapter
from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.engine.plan import ParallelPlan
from mdtriton.lora.directory import adapters_dir
from tests.distributed import run_ranks
from tests.lora.adapters import diffusers_lora, loras_input, rank_engine, with_adapters
from tests.pipeline.pipelines import max_level_difference
from tests.pipeline.test_wan_pipeline import GOOD, request
from mdtriton.testing.tiny_wan_pipeline import reference_video, save_tiny_wan_pipeline

PROMPTS = ["a red cat"]
SCALES = {"motion": 0.8, "look": -0.6}
PLANS = {"one": ParallelPlan(), "tp2": ParallelPlan(tp_size=2), "ulysses2": ParallelPlan(cp_size=2,
                                                                                        cp_method="ulysses")}


def adapted_reference_video(pipeline_dir, files: dict) -> np.ndarray:
    pipeline = with_adapters(WanPipeline.from_pretrained(pipeline_dir, local_files_only=True), files, SCALES)
    frames = pipeline(PROMPTS, height=GOOD["height"], width=GOOD["width"], num_frames=GOOD["num_frames"],
                      num_inference_steps=GOOD["num_inference_steps"], guidance_scale=GOOD["guidance_scale"],
                      generator=torch.Generator().manual_seed(GOOD["seed"]), output_type="np").frames
    return (frames * 255).round().astype(np.uint8)


def run_videos(rank: int, world_size: int, engine_dir: str, directory: str) -> list[np.ndarray]:
    """Base, adapted, base videos on one rank."""
    engine = rank_engine(rank, engine_dir, directory)
    inputs = request(PROMPTS, **GOOD)
    return [engine.forward(each)["video"].numpy() for each in (inputs, loras_input(inputs, SCALES), inputs)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["wan2.1", "wan2.2-a14b"])
def test_wan_adapters_equal_diffusers(tmp_path, layout):
    pipeline_dir = save_tiny_wan_pipeline(tmp_path / layout, layout, seed=3)
    repository = tmp_path / "repository"
    plans = PLANS if layout == "wan2.1" else {"one": PLANS["one"]}
    engines = {name: build_model_version(repository, name,
                                         BuildRequest("wan-pipeline", None, plan, "FP32", "cpu",
                                                      weights_path=pipeline_dir, progress=False)) / ENGINE_DIR
               for name, plan in plans.items()}
    transformer = WanPipeline.from_pretrained(pipeline_dir, local_files_only=True).transformer
    files = {"motion": diffusers_lora(tmp_path / "motion.safetensors", transformer, seed=1, rank=4),
             "look": diffusers_lora(tmp_path / "look.safetensors", transformer, seed=2, rank=2)}
    for name, path in files.items():
        add_adapter(repository, "one", path, name)
    directory = str(adapters_dir(repository / "one"))
    base = reference_video(pipeline_dir, PROMPTS, GOOD["height"], GOOD["width"], GOOD["num_frames"],
                           GOOD["num_inference_steps"], GOOD["guidance_scale"], GOOD["seed"])
    expected = adapted_reference_video(pipeline_dir, files)
    assert max_level_difference(expected, base) > 2  # the adapters change the video (A14B: its first expert only)
    for name, plan in plans.items():
        for videos in run_ranks(plan.world_size, run_videos, str(engines[name]), directory):
            assert max_level_difference(videos[0], base) <= 1, name
            assert max_level_difference(videos[1], expected) <= 1, name
            assert np.array_equal(videos[2], videos[0]), name
