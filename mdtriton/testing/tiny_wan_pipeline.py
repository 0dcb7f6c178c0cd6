"""Tiny random Wan pipelines in diffusers' directory layout, made offline for the pipeline tests.

Every component is Wan's class at toy sizes: a T5 tokenizer built locally (mdtriton.testing.tiny_flux_pipeline),
UMT5EncoderModel, AutoencoderKLWan (4x in time, 8x in space), WanTransformer3DModel and Wan's UniPC flow scheduler.
Layouts: Wan 2.1 (one transformer), Wan 2.2 A14B (two experts switched at boundary_ratio) and Wan 2.2 TI2V
(a timestep per token: expand_timesteps). Image to video (WanImageToVideoPipeline): Wan 2.1 I2V (a CLIP vision
encoder made from a transformers config and its image processor, both local; the image's latents and mask beside
the noise), Wan 2.2 I2V A14B (two experts, no image encoder) and Wan 2.2 TI2V given an image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import PIL.Image
from diffusers import (AutoencoderKLWan, FirstBlockCacheConfig, UniPCMultistepScheduler, WanImageToVideoPipeline,
                       WanPipeline, WanTransformer3DModel)
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

from mdtriton.families.wan.transformer import TINY_CONFIG
from mdtriton.testing.tiny_flux_pipeline import T5_SPECIALS, WORDS, t5_tokenizer

LATENT_CHANNELS = 4
LAYOUTS = ("wan2.1", "wan2.2-a14b", "wan2.2-ti2v")
I2V_LAYOUTS = ("wan2.1-i2v", "wan2.2-i2v-a14b", "wan2.2-ti2v")
IMAGE_WIDTH = 8  # the tiny CLIP vision model's width: the transformer's image_dim
# The noise, the mask (one channel per frame of the VAE's 4) and the image's latents: Wan 2.1 and 2.2 I2V's input.
I2V_CHANNELS = 2 * LATENT_CHANNELS + 4


def tiny_transformer(**changes) -> WanTransformer3DModel:
    model = WanTransformer3DModel(**{**TINY_CONFIG, "patch_size": tuple(TINY_CONFIG["patch_size"]),
                                     "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS, **changes})
    with torch.no_grad():  # modulation tables off their tiny initial values, so the conditioning matters
        for name, parameter in model.named_parameters():
            if "scale_shift_table" in name:
                parameter.mul_(5)
    return model


def tiny_wan_pipeline(layout: str = "wan2.1", seed: int = 0) -> WanPipeline:
    torch.manual_seed(seed)
    two_experts = layout == "wan2.2-a14b"
    return WanPipeline(**text_and_vae(), transformer=tiny_transformer(),
                       transformer_2=tiny_transformer() if two_experts else None,
                       boundary_ratio=0.9 if two_experts else None, expand_timesteps=layout == "wan2.2-ti2v")


def tiny_wan_i2v_pipeline(layout: str = "wan2.1-i2v", seed: int = 0) -> WanImageToVideoPipeline:
    """A tiny WanImageToVideoPipeline of an I2V_LAYOUTS layout."""
    torch.manual_seed(seed)
    if layout == "wan2.2-ti2v":
        return WanImageToVideoPipeline(**text_and_vae(), transformer=tiny_transformer(), expand_timesteps=True)
    if layout == "wan2.2-i2v-a14b":
        return WanImageToVideoPipeline(**text_and_vae(), transformer=tiny_transformer(in_channels=I2V_CHANNELS),
                                       transformer_2=tiny_transformer(in_channels=I2V_CHANNELS), boundary_ratio=0.9)
    width = TINY_CONFIG["num_attention_heads"] * TINY_CONFIG["attention_head_dim"]
    image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=IMAGE_WIDTH, intermediate_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, image_size=8, patch_size=2))
    image_processor = CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    return WanImageToVideoPipeline(**text_and_vae(), image_encoder=image_encoder, image_processor=image_processor,
                                   transformer=tiny_transformer(in_channels=I2V_CHANNELS, image_dim=IMAGE_WIDTH,
                                                                added_kv_proj_dim=width))


def text_and_vae() -> dict:
    """The tokenizer, UMT5 text encoder, VAE and scheduler every tiny Wan pipeline has."""
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(T5_SPECIALS) + 1 + len(WORDS) + 26, d_model=TINY_CONFIG["text_dim"], d_kv=4, d_ff=32,
        num_layers=1, num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
        eos_token_id=1))
    vae = AutoencoderKLWan(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                           latents_std=[1.5, 2.0, 1.0, 2.5])
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return {"tokenizer": t5_tokenizer(), "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler}


def save_tiny_wan_pipeline(directory: Path, layout: str = "wan2.1", seed: int = 0) -> Path:
    """Write a tiny pipeline into directory (diffusers' layout, safetensors weights) and return directory."""
    tiny_wan_pipeline(layout, seed).save_pretrained(directory)
    return Path(directory)


def save_tiny_wan_i2v_pipeline(directory: Path, layout: str = "wan2.1-i2v", seed: int = 0) -> Path:
    """Write a tiny image-to-video pipeline into directory and return directory."""
    tiny_wan_i2v_pipeline(layout, seed).save_pretrained(directory)
    return Path(directory)


def sample_image(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth random RGB image, UINT8 [height, width, 3] (a picture, not noise: the VAE encodes it as one)."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 3, 4, generator=generator)
    image = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    return (image[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()


def reference_i2v_video(pipeline_dir: Path, prompt: list[str], image: np.ndarray, height: int, width: int,
                        num_frames: int, steps: int, guidance: float, seed: int, last_image: np.ndarray | None = None,
                        **options) -> np.ndarray:
    """diffusers' WanImageToVideoPipeline with the same components, as UINT8 [batch, frames, height, width, 3]."""
    pipeline = WanImageToVideoPipeline.from_pretrained(pipeline_dir, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    if last_image is not None:
        options["last_image"] = PIL.Image.fromarray(last_image)
    frames = pipeline(image=PIL.Image.fromarray(image), prompt=prompt, height=height, width=width,
                      num_frames=num_frames, num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator().manual_seed(seed), output_type="np", **options).frames
    return (frames * 255).round().astype(np.uint8)


def reference_video(pipeline_dir: Path, prompt: list[str], height: int, width: int, num_frames: int, steps: int,
                    guidance: float, seed: int, cache_threshold: float | None = None, **options) -> np.ndarray:
    """diffusers' WanPipeline with the same components, as UINT8 [batch, frames, height, width, 3]; with
    cache_threshold, each of its transformers with diffusers' First Block Cache at that threshold."""
    pipeline = WanPipeline.from_pretrained(pipeline_dir, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    if cache_threshold is not None:
        for transformer in (pipeline.transformer, pipeline.transformer_2):
            if transformer is not None:
                transformer.enable_cache(FirstBlockCacheConfig(threshold=cache_threshold))
    frames = pipeline(prompt, height=height, width=width, num_frames=num_frames, num_inference_steps=steps,
                      guidance_scale=guidance, generator=torch.Generator().manual_seed(seed), output_type="np",
                      **options).frames
    return (frames * 255).round().astype(np.uint8)
