"""The tiny FLUX pipelines of the pipeline tests, their builds, and diffusers' reference images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import FluxPipeline

from mdtriton.testing.tiny_flux_pipeline import save_tiny_flux_pipeline

# FLUX.1-dev's layout (guidance embedding, dynamic shift) and FLUX.1-schnell's (neither).
LAYOUTS = {"dev": True, "schnell": False}


def save_pipelines(root: Path) -> dict[str, Path]:
    """Each layout's tiny pipeline directory, by layout name."""
    return {name: save_tiny_flux_pipeline(root / name, guidance_embeds=guidance, seed=i)
            for i, (name, guidance) in enumerate(LAYOUTS.items())}


def reference_image(pipeline_dir: Path, prompt: list[str], height: int, width: int, steps: int, guidance: float,
                    seed: int, dtype: torch.dtype = torch.float32, **options) -> np.ndarray:
    """diffusers' FluxPipeline with the same components, as UINT8 [batch, height, width, 3]."""
    pipeline = FluxPipeline.from_pretrained(pipeline_dir, local_files_only=True, dtype=dtype)
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator().manual_seed(seed), output_type="np", **options).images
    return (images * 255).round().astype(np.uint8)


def cached_reference_image(pipeline_dir: Path, prompt: list[str], height: int, width: int, steps: int,
                           guidance: float, seed: int, cache) -> tuple[np.ndarray, int]:
    """diffusers' FluxPipeline image after `transformer.enable_cache(cache)` (a diffusers cache config), and how many
    steps ran the whole transformer (its last attention's)."""
    pipeline = FluxPipeline.from_pretrained(pipeline_dir, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.transformer.enable_cache(cache)
    full = []
    pipeline.transformer.single_transformer_blocks[-1].attn.to_q.register_forward_hook(lambda *_: full.append(1))
    images = pipeline(prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator().manual_seed(seed), output_type="np").images
    return (images * 255).round().astype(np.uint8), len(full)


def max_level_difference(image: np.ndarray, reference: np.ndarray) -> int:
    assert image.shape == reference.shape and image.dtype == np.uint8
    return int(np.abs(image.astype(np.int16) - reference.astype(np.int16)).max())


def mean_level_difference(image: np.ndarray, reference: np.ndarray) -> float:
    assert image.shape == reference.shape and image.dtype == np.uint8
    return float(np.abs(image.astype(np.int16) - reference.astype(np.int16)).mean())
