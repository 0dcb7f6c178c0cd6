"""A tiny random Cosmos 3 pipeline in diffusers' directory layout, made offline for the pipeline tests.

Every component is Cosmos3OmniPipeline's class at toy sizes: a byte-level BPE tokenizer (one token per UTF-8 byte, as
Qwen's tokenizer without its merges) built locally with `tokenizers`, with the special tokens the pipeline reads
(<|im_end|>, <|vision_start|>) and a chat template in Qwen's form; a Wan 2.2-style AutoencoderKLWan (residual, 2x2
patches: 16x in space, 4x in time); Cosmos3OmniTransformer; UniPC's flow scheduler. No safety checker.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, FirstBlockCacheConfig, UniPCMultistepScheduler
from diffusers.hooks._helpers import TransformerBlockMetadata
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mdtriton.families.cosmos3.transformer import TINY_CONFIG
from mdtriton.testing.cosmos3_cases import diffusers_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>"]
CHAT_TEMPLATE = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{%- endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens, then the special ones (260 ids: TINY_CONFIG's vocabulary of 264 holds them)."""
    vocab = {token: index for index, token in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({token: len(vocab) + index for index, token in enumerate(SPECIALS)})
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS, chat_template=CHAT_TEMPLATE)


def tiny_cosmos3_pipeline(seed: int = 0) -> Cosmos3OmniPipeline:
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=8, z_dim=TINY_CONFIG["latent_channel"], dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                           patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                           latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 2.0, 1.0, 2.5])
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return Cosmos3OmniPipeline(transformer=diffusers_model(TINY_CONFIG, seed), text_tokenizer=byte_tokenizer(),
                               vae=vae, scheduler=scheduler, enable_safety_checker=False)


def save_tiny_cosmos3_pipeline(directory: Path, seed: int = 0) -> Path:
    """Write a tiny pipeline into directory (diffusers' layout, safetensors weights) and return directory."""
    tiny_cosmos3_pipeline(seed).save_pretrained(directory)
    return Path(directory)


def reference_video(pipeline_dir: Path, prompt: str, height: int, width: int, num_frames: int, steps: int,
                    guidance: float, seed: int, cache_threshold: float | None = None, **options) -> np.ndarray:
    """diffusers' Cosmos3OmniPipeline with the same components, as UINT8 [1, frames, height, width, 3]; with
    cache_threshold, its transformer with diffusers' First Block Cache at that threshold (block_arguments_by_name)."""
    pipeline = Cosmos3OmniPipeline.from_pretrained(pipeline_dir, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    if cache_threshold is not None:
        block_arguments_by_name()
        pipeline.transformer.enable_cache(FirstBlockCacheConfig(threshold=cache_threshold))
    video = pipeline(prompt, height=height, width=width, num_frames=num_frames, num_inference_steps=steps,
                     guidance_scale=guidance, generator=torch.Generator().manual_seed(seed), output_type="np",
                     **options).video
    return (video * 255).round().astype(np.uint8)[None]


def block_arguments_by_name() -> None:
    """Let diffusers 0.42.1's First Block Cache run on Cosmos 3, as its block registry describes the layer: the cache's
    head hook asks for the layer's argument "hidden_states" by that name, where Cosmos 3's layer calls it gen_seq (and
    its text und_seq), which the registered metadata names; here the hooks' "hidden_states" and
    "encoder_hidden_states" are read by the metadata's names."""
    if getattr(TransformerBlockMetadata, "by_name", False):
        return
    read = TransformerBlockMetadata._get_parameter_from_args_kwargs

    def by_metadata_name(metadata, identifier, args=(), kwargs=None):
        names = {"hidden_states": metadata.hidden_states_argument_name,
                 "encoder_hidden_states": metadata.encoder_hidden_states_argument_name}
        return read(metadata, names.get(identifier, identifier), args, kwargs)

    TransformerBlockMetadata._get_parameter_from_args_kwargs = by_metadata_name
    TransformerBlockMetadata.by_name = True
