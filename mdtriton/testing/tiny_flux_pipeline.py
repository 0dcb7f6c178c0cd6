"""A tiny random FLUX pipeline in diffusers' directory layout, made offline for the pipeline tests.

Every component is FLUX.1's class at toy sizes: CLIP and T5 tokenizers built locally with `tokenizers`
(word-level vocabularies) and wrapped in transformers' fast tokenizer classes, CLIPTextModel,
T5EncoderModel, an AutoencoderKL with FLUX's 8x compression, FluxTransformer2DModel and
FlowMatchEulerDiscreteScheduler, all written with save_pretrained (model_index.json included). FLUX.1 Kontext's
pipeline (FluxKontextPipeline: an input image's latent tokens appended to the sequence) takes the same components, its
transformer's attention sharpened (sharpen_attention) so that the input image matters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline,
                       FluxTransformer2DModel)
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizerFast, T5Config, T5EncoderModel, T5TokenizerFast

WORDS = ["a", "an", "the", "cat", "dog", "red", "blue", "sign", "on", "with", "hello", "world", "photo", "of"]
CLIP_SPECIALS = ["<|endoftext|>", "<|startoftext|>"]
T5_SPECIALS = ["<pad>", "</s>", "<unk>"]
TEXT_2_DIM = 32  # T5 d_model = the transformer's joint_attention_dim
POOLED_DIM = 24  # CLIP hidden size = the transformer's pooled_projection_dim
QK_NORM_SCALE = 8.0


def clip_tokenizer() -> CLIPTokenizerFast:
    # CLIPTokenizerFast needs a BPE model with CLIP's end-of-word suffix: letters only, no merges.
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {token: i for i, token in enumerate(CLIP_SPECIALS + letters + [f"{c}</w>" for c in letters])}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<|endoftext|>", end_of_word_suffix="</w>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 1), ("<|endoftext|>", 0)])
    return CLIPTokenizerFast(tokenizer_object=tokenizer, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                             pad_token="<|endoftext|>", unk_token="<|endoftext|>", model_max_length=77)


def t5_tokenizer() -> T5TokenizerFast:
    # T5's layout: <pad>, </s>, <unk>, then SentencePiece-style pieces (the class builds the Unigram model).
    pieces = [("▁", -2.0)] + [(f"▁{word}", -1.0) for word in WORDS] + [(chr(c), -5.0) for c in range(ord("a"), ord("z") + 1)]
    return T5TokenizerFast(vocab=[(token, 0.0) for token in T5_SPECIALS] + pieces, extra_ids=0, model_max_length=512)


def tiny_flux_pipeline(guidance_embeds: bool = True, seed: int = 0) -> FluxPipeline:
    """FLUX.1-dev's layout (guidance_embeds=True, dynamic shift) or FLUX.1-schnell's (no guidance, fixed shift)."""
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(CLIP_SPECIALS) + 2 * 26, hidden_size=POOLED_DIM, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=1, eos_token_id=0, pad_token_id=0)).eval()
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(T5_SPECIALS) + 1 + len(WORDS) + 26, d_model=TEXT_2_DIM, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1)).eval()
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=2, block_out_channels=(4, 8, 8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
                        scaling_factor=0.3611, shift_factor=0.1159)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=TEXT_2_DIM, pooled_projection_dim=POOLED_DIM, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6))
    if guidance_embeds:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=clip_tokenizer(),
                        text_encoder_2=text_encoder_2, tokenizer_2=t5_tokenizer(), transformer=transformer)


def sharpen_attention(transformer: torch.nn.Module) -> torch.nn.Module:
    """The transformer with its query and key norms scaled by QK_NORM_SCALE (attention logits by its square). At
    initial weights attention is near uniform over the 512 padded text tokens, and an input image's few tokens
    changed the image by less than a uint8 level: a test could not see them dropped."""
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                parameter.mul_(QK_NORM_SCALE)
    return transformer


def tiny_flux_kontext_pipeline(seed: int = 0) -> FluxKontextPipeline:
    """FLUX.1 Kontext [dev]'s layout: FLUX.1-dev's components (guidance embedded, dynamic shift) in Kontext's pipeline,
    the transformer's attention sharpened so that the input image matters."""
    components = tiny_flux_pipeline(guidance_embeds=True, seed=seed).components
    return FluxKontextPipeline(**{**components, "transformer": sharpen_attention(components["transformer"])})


def save_tiny_flux_pipeline(directory: Path, guidance_embeds: bool = True, seed: int = 0) -> Path:
    """Write a tiny pipeline into directory (diffusers' layout, safetensors weights) and return directory."""
    tiny_flux_pipeline(guidance_embeds, seed).save_pretrained(directory)
    return Path(directory)
