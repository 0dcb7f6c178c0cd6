"""LoRA adapters on a pipeline served with diffusers' own transformer (mdtriton.pipeline.generic): Qwen-Image split by
Ulysses on 2 gloo ranks, its adapters kept by `mdtriton lora add` and merged into every rank's whole transformer for
the requests that name them, equals diffusers' QwenImagePipeline with `load_lora_weights` + `set_adapters` within one
level; a request without adapters after them gets the base image again."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline

from mdtriton.build_tools.adapters import add_adapter
from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.engine.plan import ParallelPlan
from mdtriton.lora.directory import adapters_dir
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.testing.tiny_qwen_image_pipeline import save_tiny_qwen_image_pipeline
from tests.distributed import run_ranks
from tests.lora.adapters import diffusers_lora, loras_input, rank_engine, with_adapters
from tests.pipeline.pipelines import max_level_difference

PROMPT, NEGATIVE = "a red cat on a blue mat", "blurry"
GOOD = dict(height=64, width=48, num_inference_steps=2, true_cfg_scale=4.0, seed=7)
SCALES = {"style": 0.8, "detail": -0.6}


def request() -> dict[str, torch.Tensor]:
    types = {"height": torch.int32, "width": torch.int32, "num_inference_steps": torch.int32,
             "true_cfg_scale": torch.float32, "seed": torch.int64}
    return {"prompt": torch.from_numpy(prompt_tensor([PROMPT])),
            "negative_prompt": torch.from_numpy(prompt_tensor([NEGATIVE], "negative_prompt")),
            **{name: torch.tensor([GOOD[name]], dtype=dtype) for name, dtype in types.items()}}


def run_images(rank: int, world_size: int, engine_dir: str, directory: str) -> list[np.ndarray]:
    """Base, adapted, base images on one rank."""
    engine = rank_engine(rank, engine_dir, directory)
    inputs = request()
    return [engine.forward(each)["image"].numpy() for each in (inputs, loras_input(inputs, SCALES), inputs)]


def reference(pipeline_dir, files: dict) -> np.ndarray:
    """diffusers' QwenImagePipeline in this process, with the adapters of SCALES loaded and set where files are
    given."""
    pipeline = QwenImagePipeline.from_pretrained(pipeline_dir, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    if files:
        with_adapters(pipeline, files, SCALES)
    images = pipeline(PROMPT, negative_prompt=NEGATIVE, height=GOOD["height"], width=GOOD["width"],
                      num_inference_steps=GOOD["num_inference_steps"], true_cfg_scale=GOOD["true_cfg_scale"],
                      generator=torch.Generator().manual_seed(GOOD["seed"]), output_type="np").images
    return (images * 255).round().astype(np.uint8)


@pytest.mark.timeout(600)
def test_qwen_image_adapters_equal_diffusers_on_two_ranks(tmp_path):
    pipeline_dir = save_tiny_qwen_image_pipeline(tmp_path / "pipeline")
    repository = tmp_path / "repository"
    engine_dir = build_model_version(repository, "qwen", BuildRequest(
        "qwen-image-pipeline", None, ParallelPlan(cp_size=2, cp_method="ulysses"), "FP32", "cpu",
        weights_path=pipeline_dir, progress=False)) / ENGINE_DIR
    transformer = QwenImagePipeline.from_pretrained(pipeline_dir, local_files_only=True).transformer
    files = {"style": diffusers_lora(tmp_path / "style.safetensors", transformer, seed=1, rank=4),
             "detail": diffusers_lora(tmp_path / "detail.safetensors", transformer, seed=2, rank=2)}
    for name, path in files.items():
        add_adapter(repository, "qwen", path, name)
    base, adapted = reference(pipeline_dir, {}), reference(pipeline_dir, files)
    assert max_level_difference(adapted, base) > 1  # the adapters change the image
    for images in run_ranks(2, run_images, str(engine_dir), str(adapters_dir(repository / "qwen"))):
        assert max_level_difference(images[0], base) <= 1
        assert max_level_difference(images[1], adapted) <= 1
        assert np.array_equal(images[2], images[0])  # the base weights put back exactly
