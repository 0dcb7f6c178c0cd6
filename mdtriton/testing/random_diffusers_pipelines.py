"""The named pipelines served with diffusers' own transformer that the pipeline benchmarks build besides Qwen-Image
(mdtriton.testing.random_pipelines): Qwen-Image-Edit-Plus, FLUX.2 [dev], FLUX.2 [klein] and LTX-2.

Each is a diffusers directory holding every component, the transformer's weights too (the build copies the directory:
mdtriton.pipeline.generic): at the published configs, random weights made on the device in bf16 from seed 0, one
component at a time (each saved and dropped before the next is made, so that FLUX.2 [dev]'s 32 B transformer and 24 B
text encoder need not fit on the GPU together); or the tests' tiny pipelines (float32, on the CPU). The tokenizers are
the tiny pipelines' small local ones (each tokenizer class over byte tokens): token ids do not change the work, and
every pipeline here pads its prompt to a fixed length (FLUX.2: 512 tokens, LTX-2: 1,024) or takes a template longer
than the tokens it drops. Their parameters in bf16 (what the directory takes on disk): Qwen-Image-Edit-Plus 58 GB,
FLUX.2 [dev] 113 GB, FLUX.2 [klein] 4B 16 GB, LTX-2 68 GB.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from mdtriton.testing.random_pipelines import in_bf16, qwen_image_makers, save_made_components
from mdtriton.testing.tiny_flux2_pipeline import (flux2_scheduler, mistral_tokenizer, save_tiny_flux2_klein_pipeline,
                                                  save_tiny_flux2_pipeline)
from mdtriton.testing.tiny_ltx2_pipeline import gemma_tokenizer, save_tiny_ltx2_pipeline
from mdtriton.testing.tiny_qwen_image_pipeline import (qwen_tokenizer, save_qwen2vl_processor,
                                                       save_tiny_qwen_image_edit_plus_pipeline)

# Qwen/Qwen-Image-Edit-2509: its transformer, text encoder and VAE are Qwen-Image's configs (transformer/config.json
# equals Qwen/Qwen-Image's); its processor is Qwen2.5-VL's (preprocessor_config.json: 56x56 to 3584x3584 pixels).
QWEN_IMAGE_EDIT_PLUS_PROCESSOR = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16384)
# black-forest-labs/FLUX.2-dev's transformer: diffusers' scripts/convert_flux2_to_diffusers.py ("flux2-dev"; also
# Flux2Transformer2DModel's defaults). Its VAE is AutoencoderKLFlux2's defaults, as that script converts it.
FLUX2_DEV_TRANSFORMER = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                             num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
                             mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
                             guidance_embeds=True)
# FLUX.2 [dev]'s text encoder: Mistral Small 3.1 24B (mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json, as
# the conversion script takes it), its text model and Pixtral vision tower.
MISTRAL_SMALL_3_1_TEXT = dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                              num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=None,
                              tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1e9))
MISTRAL_SMALL_3_1_VISION = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                num_attention_heads=16, head_dim=64, patch_size=14, image_size=1540,
                                hidden_act="silu", rope_parameters=dict(rope_type="default", rope_theta=10000.0))
# black-forest-labs/FLUX.2-klein-4B's transformer: the conversion script's "klein-4b" (guidance distilled into 4 steps:
# model_index.json's is_distilled).
FLUX2_KLEIN_4B_TRANSFORMER = dict(FLUX2_DEV_TRANSFORMER, num_layers=5, num_single_layers=20, num_attention_heads=24,
                                  joint_attention_dim=7680, guidance_embeds=False)
# FLUX.2 [klein] 4B's text encoder: Qwen/Qwen3-4B's config.json.
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e6))
# Lightricks/LTX-2 (19 B): diffusers' scripts/convert_ltx2_to_diffusers.py, version "2.0": the transformer, the text
# connectors, the video VAE, the audio VAE, the vocoder and the scheduler.
LTX2_TRANSFORMER = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                        attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32),
                        pos_embed_max_pos=20, base_height=2048, base_width=2048, audio_in_channels=128,
                        audio_out_channels=128, audio_patch_size=1, audio_patch_size_t=1, audio_num_attention_heads=32,
                        audio_attention_head_dim=64, audio_cross_attention_dim=2048, audio_scale_factor=4,
                        audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160, num_layers=48,
                        activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
                        norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840, attention_bias=True,
                        attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
                        timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split")
LTX2_CONNECTORS = dict(caption_channels=3840, text_proj_in_factor=49, video_connector_num_attention_heads=30,
                       video_connector_attention_head_dim=128, video_connector_num_layers=2,
                       video_connector_num_learnable_registers=128, audio_connector_num_attention_heads=30,
                       audio_connector_attention_head_dim=128, audio_connector_num_layers=2,
                       audio_connector_num_learnable_registers=128, connector_rope_base_seq_len=4096,
                       rope_theta=10000.0, rope_double_precision=True, causal_temporal_positioning=False,
                       rope_type="split")
LTX2_VIDEO_VAE = dict(in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(256, 512, 1024, 2048),
                      down_block_types=("LTX2VideoDownBlock3D",) * 4, decoder_block_out_channels=(256, 512, 1024),
                      layers_per_block=(4, 6, 6, 2, 2), decoder_layers_per_block=(5, 5, 5, 5),
                      spatio_temporal_scaling=(True,) * 4, decoder_spatio_temporal_scaling=(True,) * 3,
                      decoder_inject_noise=(False,) * 4,
                      downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                      upsample_residual=(True,) * 3, upsample_factor=(2, 2, 2), timestep_conditioning=False,
                      patch_size=4, patch_size_t=1, resnet_norm_eps=1e-6, encoder_causal=True, decoder_causal=False,
                      encoder_spatial_padding_mode="zeros", decoder_spatial_padding_mode="reflect",
                      spatial_compression_ratio=32, temporal_compression_ratio=8)
LTX2_AUDIO_VAE = dict(base_channels=128, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=2, attn_resolutions=None,
                      in_channels=2, resolution=256, latent_channels=8, norm_type="pixel", causality_axis="height",
                      dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160,
                      is_causal=True, mel_bins=64, double_z=True)
LTX2_VOCODER = dict(in_channels=128, hidden_channels=1024, out_channels=2, upsample_kernel_sizes=[16, 15, 8, 4, 4],
                    upsample_factors=[6, 5, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11],
                    resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]], leaky_relu_negative_slope=0.1,
                    output_sampling_rate=24000)
LTX2_SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                      max_image_seq_len=4096, shift_terminal=0.1)
# LTX-2's text encoder: Gemma 3 12B (google/gemma-3-12b-it's config.json, the script's text encoder), its text model
# (global layers: linear RoPE scaling by 8; local layers: 1,024-token windows) and SigLIP vision tower.
GEMMA3_12B_TEXT = dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                       max_position_embeddings=131072, sliding_window=1024, rms_norm_eps=1e-6,
                       rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                        "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})
GEMMA3_12B_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                         image_size=896, patch_size=14, vision_use_head=False)


def with_transformer_config(directory: Path) -> tuple[Path, dict]:
    """directory and its transformer's config as written (without diffusers' own "_" keys)."""
    config = json.loads((directory / "transformer" / "config.json").read_text())
    return directory, {key: value for key, value in config.items() if not key.startswith("_")}


def qwen_image_edit_plus_pipeline_dir(directory: Path, tiny: bool, device: torch.device) -> tuple[Path, dict]:
    """A Qwen-Image-Edit-Plus (2509) pipeline directory: Qwen-Image's components at its published configs
    (mdtriton.testing.random_pipelines.qwen_image_makers) and Qwen2.5-VL's processor, laid out as the published
    checkpoint's (the `processor` folder naming Qwen2VLProcessor); or the tests' tiny one. Its transformer's config."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if tiny:
        return with_transformer_config(save_tiny_qwen_image_edit_plus_pipeline(directory))
    save_made_components(directory, "QwenImageEditPlusPipeline", qwen_image_makers(device))
    save_qwen2vl_processor(directory, Qwen2VLImageProcessorPil(**QWEN_IMAGE_EDIT_PLUS_PROCESSOR), qwen_tokenizer())
    return with_transformer_config(directory)


def flux2_pipeline_dir(directory: Path, tiny: bool, device: torch.device) -> tuple[Path, dict]:
    """A FLUX.2 [dev] pipeline directory (flux2_makers; or the tests' tiny one) and its transformer's config."""
    if tiny:
        return with_transformer_config(save_tiny_flux2_pipeline(directory))
    return with_transformer_config(save_made_components(directory, "Flux2Pipeline", flux2_makers(device)))


def flux2_makers(device: torch.device) -> dict[str, Callable[[], object]]:
    """FLUX.2 [dev]'s components at the published configs, each by the call that makes it: the 32 B transformer,
    Mistral Small 3.1 24B and the FLUX.2 VAE on device in bf16, a local tokenizer, the scheduler."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = mistral_tokenizer()
    text_config = dict(MISTRAL_SMALL_3_1_TEXT, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    encoder_config = Mistral3Config(text_config=text_config, vision_config=MISTRAL_SMALL_3_1_VISION,
                                    image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
                                    projector_hidden_act="gelu", multimodal_projector_bias=False,
                                    tie_word_embeddings=False)
    return {"transformer": in_bf16(lambda: Flux2Transformer2DModel(**FLUX2_DEV_TRANSFORMER), device),
            "text_encoder": in_bf16(lambda: Mistral3ForConditionalGeneration(encoder_config).eval(), device),
            "vae": in_bf16(AutoencoderKLFlux2, device),
            "tokenizer": lambda: tokenizer, "scheduler": flux2_scheduler}


def flux2_klein_pipeline_dir(directory: Path, tiny: bool, device: torch.device) -> tuple[Path, dict]:
    """A FLUX.2 [klein] 4B pipeline directory (flux2_klein_makers, guidance distilled; or the tests' tiny one, the base
    layout: not distilled) and its transformer's config."""
    if tiny:
        return with_transformer_config(save_tiny_flux2_klein_pipeline(directory))
    return with_transformer_config(save_made_components(directory, "Flux2KleinPipeline", flux2_klein_makers(device),
                                                        {"is_distilled": True}))


def flux2_klein_makers(device: torch.device) -> dict[str, Callable[[], object]]:
    """FLUX.2 [klein] 4B's components at the published configs, each by the call that makes it: the 4 B transformer,
    Qwen3 4B and the FLUX.2 VAE on device in bf16, a local tokenizer, the scheduler."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen_tokenizer()
    encoder_config = Qwen3Config(**QWEN3_4B, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                                 eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return {"transformer": in_bf16(lambda: Flux2Transformer2DModel(**FLUX2_KLEIN_4B_TRANSFORMER), device),
            "text_encoder": in_bf16(lambda: Qwen3ForCausalLM(encoder_config).eval(), device),
            "vae": in_bf16(AutoencoderKLFlux2, device),
            "tokenizer": lambda: tokenizer, "scheduler": flux2_scheduler}


def ltx2_pipeline_dir(directory: Path, tiny: bool, device: torch.device) -> tuple[Path, dict]:
    """An LTX-2 text-to-video-with-sound pipeline directory (ltx2_makers; or the tests' tiny one) and its
    transformer's config."""
    if tiny:
        return with_transformer_config(save_tiny_ltx2_pipeline(directory))
    return with_transformer_config(save_made_components(directory, "LTX2Pipeline", ltx2_makers(device)))


def ltx2_makers(device: torch.device) -> dict[str, Callable[[], object]]:
    """LTX-2's components at the published configs, each by the call that makes it: the 19 B transformer, Gemma 3 12B,
    the text connectors, the video and audio VAEs and the vocoder on device in bf16, a local tokenizer, the
    scheduler."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = gemma_tokenizer()
    start_of_image, end_of_image, image_token = tokenizer.convert_tokens_to_ids(
        ["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    text_config = dict(GEMMA3_12B_TEXT, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    encoder_config = Gemma3Config(text_config=text_config, vision_config=GEMMA3_12B_VISION, mm_tokens_per_image=256,
                                  boi_token_index=start_of_image, eoi_token_index=end_of_image,
                                  image_token_index=image_token)
    return {"transformer": in_bf16(lambda: LTX2VideoTransformer3DModel(**LTX2_TRANSFORMER), device),
            "text_encoder": in_bf16(lambda: Gemma3ForConditionalGeneration(encoder_config).eval(), device),
            "connectors": in_bf16(lambda: LTX2TextConnectors(**LTX2_CONNECTORS), device),
            "vae": in_bf16(lambda: AutoencoderKLLTX2Video(**LTX2_VIDEO_VAE), device),
            "audio_vae": in_bf16(lambda: AutoencoderKLLTX2Audio(**LTX2_AUDIO_VAE), device),
            "vocoder": in_bf16(lambda: LTX2Vocoder(**LTX2_VOCODER), device),
            "tokenizer": lambda: tokenizer, "scheduler": lambda: FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER)}
