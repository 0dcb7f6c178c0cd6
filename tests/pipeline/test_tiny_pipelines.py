"""The tiny pipelines of mdtriton.testing for diffusers' Qwen-Image, FLUX.2 [klein] and [dev] and FLUX.1 Kontext
pipelines: each written with save_pretrained, loaded back by DiffusionPipeline offline as its own class, makes a
finite, not constant image of the asked size in 2 steps (with its input image where it takes one), the same twice
from one seed, another where its input image is another, and its transformer class declares a context-parallel
plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from mdtriton.testing.tiny_flux2_pipeline import tiny_flux2_klein_pipeline, tiny_flux2_pipeline
from mdtriton.testing.tiny_flux_pipeline import tiny_flux_kontext_pipeline
from mdtriton.testing.tiny_qwen_image_pipeline import tiny_qwen_image_pipeline

SIDE = 64


def input_image() -> Image.Image:
    """A seeded random RGB image of SIDE x SIDE pixels."""
    pixels = np.random.default_rng(3).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


# Pipeline class name: the tiny pipeline's maker, and the call's options besides the seed, steps and size.
CASES = {
    "QwenImagePipeline": (tiny_qwen_image_pipeline, dict(negative_prompt="blurry", true_cfg_scale=4.0)),
    "Flux2KleinPipeline": (tiny_flux2_klein_pipeline, dict(guidance_scale=4.0)),
    "Flux2KleinPipeline+image": (tiny_flux2_klein_pipeline, dict(guidance_scale=4.0, image=input_image())),
    "Flux2Pipeline": (tiny_flux2_pipeline, dict(guidance_scale=4.0, image=input_image())),
    # Kontext scales its output to max_area and its input image to a published resolution unless told not to.
    "FluxKontextPipeline": (tiny_flux_kontext_pipeline, dict(image=input_image(), max_area=SIDE * SIDE,
                                                             _auto_resize=False)),
}


@pytest.mark.parametrize("case", CASES)
def test_tiny_pipeline_saved_and_loaded_makes_a_seeded_image(case, tmp_path):
    make, options = CASES[case]
    make(seed=0).save_pretrained(tmp_path)
    pipeline = DiffusionPipeline.from_pretrained(tmp_path, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    assert type(pipeline).__name__ == case.split("+")[0]
    assert type(pipeline.transformer)._cp_plan, "the generic family splits the transformer by its _cp_plan"

    def image(**changed) -> np.ndarray:
        return pipeline(prompt="a red cat on a blue sign", height=SIDE, width=SIDE, num_inference_steps=2,
                        generator=torch.Generator().manual_seed(7), output_type="np", **{**options, **changed}).images

    first = image()
    assert first.shape == (1, SIDE, SIDE, 3)
    assert np.isfinite(first).all()
    assert first.std() > 1e-3, "a constant image"
    np.testing.assert_array_equal(image(), first)
    if "image" in options:
        negative = Image.fromarray(255 - np.asarray(options["image"]))
        # More than 2 uint8 levels apart: a served image within 1 level of diffusers' cannot have lost its input image.
        assert np.abs(image(image=negative) - first).max() > 2 / 255, "the input image made no difference"
