"""Tiny random LTX-2 pipelines (video with sound) in diffusers' directory layout, made offline for the tests.

Every component is LTX-2's class at the toy sizes of diffusers' own LTX-2 tests (tests/pipelines/ltx2): Gemma's
tokenizer class over byte tokens made locally (Gemma's special tokens, then one token per UTF-8 byte, byte fallback,
no merges) and a Gemma 3 text encoder (two text layers of width 32, a one-layer SigLIP vision tower); the text
connectors (video and audio streams); LTX2VideoTransformer3DModel (2 layers, 2 heads per stream, split RoPE);
AutoencoderKLLTX2Video (2x in space and time: a clip of H x W pixels and F = 2k+1 frames is (k+1) x H/2 x W/2 video
tokens), AutoencoderKLLTX2Audio (8 mel bins, 16 kHz, a mel frame each 160 samples) and the vocoder (stereo, 16 kHz:
160 samples a mel frame, so that the sound lasts as long as the clip, as LTX-2's does); FLUX's flow-matching scheduler
with its default config. A 2-step 32x32 clip of 5 frames takes about a second on one CPU core.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                       LTX2ImageToVideoPipeline, LTX2Pipeline, LTX2VideoTransformer3DModel)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>"]
TEXT_WIDTH = 32  # the connectors' width (4 heads of 8) is the text encoder's
TEXT_LAYERS = 2


def gemma_tokenizer() -> GemmaTokenizer:
    """Gemma's tokenizer class (left padding, <bos> first) over its special tokens and 256 byte tokens: every text
    is its UTF-8 bytes."""
    vocab = {token: index for index, token in enumerate(GEMMA_SPECIALS)}
    vocab.update({f"<0x{byte:02X}>": len(GEMMA_SPECIALS) + byte for byte in range(256)})
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=1024)


def gemma3_text_encoder(tokenizer: GemmaTokenizer) -> Gemma3ForConditionalGeneration:
    """Gemma 3 at toy sizes, its vocabulary the tokenizer's."""
    start_of_image, end_of_image, image_token = tokenizer.convert_tokens_to_ids(GEMMA_SPECIALS[5:])
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=32,
                         num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=1024, sliding_window=64, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=start_of_image, eoi_token_index=end_of_image,
        image_token_index=image_token)
    return Gemma3ForConditionalGeneration(config).eval()


def tiny_ltx2_parts(seed: int = 0) -> dict:
    """The components LTX-2's text-to-video and image-to-video pipelines share, seeded."""
    torch.manual_seed(seed)
    tokenizer = gemma_tokenizer()
    text_encoder = gemma3_text_encoder(tokenizer)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=TEXT_WIDTH, rope_double_precision=False, rope_type="split")
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_WIDTH, text_proj_in_factor=TEXT_LAYERS + 1, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[20, 8, 8],
        upsample_factors=[10, 4, 4],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000)
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)


def tiny_ltx2_pipeline(seed: int = 0) -> LTX2Pipeline:
    """LTX-2's text-to-video-with-audio pipeline at toy sizes, its random weights drawn from seed."""
    return LTX2Pipeline(**tiny_ltx2_parts(seed))


def tiny_ltx2_image_to_video_pipeline(seed: int = 0) -> LTX2ImageToVideoPipeline:
    """LTX-2's image-to-video-with-audio pipeline at toy sizes, its random weights drawn from seed."""
    return LTX2ImageToVideoPipeline(**tiny_ltx2_parts(seed))


def save_tiny_ltx2_pipeline(directory: Path, seed: int = 0) -> Path:
    """Write a tiny text-to-video pipeline into directory (diffusers' layout, safetensors weights) and return it."""
    tiny_ltx2_pipeline(seed).save_pretrained(directory)
    return Path(directory)


def save_tiny_ltx2_image_to_video_pipeline(directory: Path, seed: int = 0) -> Path:
    """Write a tiny image-to-video pipeline into directory (diffusers' layout, safetensors weights) and return it."""
    tiny_ltx2_image_to_video_pipeline(seed).save_pretrained(directory)
    return Path(directory)
