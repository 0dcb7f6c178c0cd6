"""The tiny LTX-2 pipelines of mdtriton.testing (text to video and image to video, with sound): each written with
save_pretrained, loaded back by DiffusionPipeline offline as its own class, makes a finite, not constant clip of the
asked size and frames and a finite, not silent sound of the clip's length in 2 steps, the same twice from one seed;
its transformer class declares a context-parallel plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from mdtriton.testing.tiny_ltx2_pipeline import tiny_ltx2_image_to_video_pipeline, tiny_ltx2_pipeline

FRAMES, FRAME_RATE, SIDE = 5, 25.0, 32
IMAGE = Image.fromarray(np.random.default_rng(3).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8))
CASES = {"LTX2Pipeline": (tiny_ltx2_pipeline, {}),
         "LTX2ImageToVideoPipeline": (tiny_ltx2_image_to_video_pipeline, {"image": IMAGE})}


@pytest.mark.parametrize("case", CASES)
def test_tiny_pipeline_saved_and_loaded_makes_a_seeded_clip_with_sound(case, tmp_path):
    make, options = CASES[case]
    make(seed=0).save_pretrained(tmp_path)
    pipeline = DiffusionPipeline.from_pretrained(tmp_path, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    assert type(pipeline).__name__ == case
    assert type(pipeline.transformer)._cp_plan, "the generic family splits the transformer by its _cp_plan"

    def clip():
        return pipeline(prompt="a robot dancing", negative_prompt="blurry", height=SIDE, width=SIDE,
                        num_frames=FRAMES, frame_rate=FRAME_RATE, num_inference_steps=2,
                        generator=torch.Generator().manual_seed(7), output_type="pt", **options)

    first = clip()
    assert first.frames.shape == (1, FRAMES, 3, SIDE, SIDE)
    assert torch.isfinite(first.frames).all() and first.frames.std() > 1e-3, "a constant clip"
    channels = pipeline.vocoder.config.out_channels
    samples_per_second = pipeline.vocoder.config.output_sampling_rate
    assert first.audio.shape[:2] == (1, channels)
    # The sound lasts about as long as the frames at the frame rate (whole audio latents of 40 ms).
    assert abs(first.audio.shape[2] / samples_per_second - FRAMES / FRAME_RATE) <= 0.05
    assert torch.isfinite(first.audio).all() and first.audio.std() > 1e-4, "a silent sound"
    second = clip()
    torch.testing.assert_close(second.frames, first.frames, rtol=0, atol=0)
    torch.testing.assert_close(second.audio, first.audio, rtol=0, atol=0)
