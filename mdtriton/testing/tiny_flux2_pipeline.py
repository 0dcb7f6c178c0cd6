"""Tiny random FLUX.2 pipelines in diffusers' directory layout, made offline for the tests.

Both share AutoencoderKLFlux2 (8x in space, 4 latent channels), Flux2Transformer2DModel (2x2 patches of latents: an
image of H x W pixels, both multiples of 16, is H/16 x W/16 image tokens; an input image's tokens are appended to
them) and FLUX.2's flow-matching scheduler; each pipeline stacks three hidden states of its text encoder (text
embeddings of width 48, 512 tokens a prompt). A 2-step 64x64 image takes well under a second on one CPU core.
The transformer's attention is sharpened (mdtriton.testing.tiny_flux_pipeline.sharpen_attention), so that an input
image changes the image by several uint8 levels.
- FLUX.2 [klein] (Flux2KleinPipeline): Qwen's tokenizer class over local byte tokens (as Qwen-Image's tiny pipeline
  makes it, mdtriton.testing.tiny_qwen_image_pipeline) and a Qwen3 text encoder of 27 layers of width 16 (the
  pipeline reads layers 9, 18 and 27).
- FLUX.2 [dev] (Flux2Pipeline): a Mistral 3 text encoder of 30 layers of width 16 (the pipeline reads layers 10, 20
  and 30; a one-layer Pixtral vision tower) and, as its `tokenizer`, a byte-level fast tokenizer with Mistral's
  special tokens and a chat template in Mistral's form. The published pipeline's `tokenizer` is a PixtralProcessor,
  which transformers builds only with torchvision; the pipeline calls only its apply_chat_template, on text, which a
  tokenizer answers alike (prompt upsampling, which gives it images, is not covered).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline,
                       Flux2Transformer2DModel)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (Mistral3Config, Mistral3ForConditionalGeneration, PreTrainedTokenizerFast, Qwen3Config,
                          Qwen3ForCausalLM)

from mdtriton.testing.tiny_flux_pipeline import sharpen_attention
from mdtriton.testing.tiny_qwen_image_pipeline import qwen_tokenizer

KLEIN_TEXT_LAYERS = 27  # Flux2KleinPipeline reads hidden states 9, 18 and 27 by default
DEV_TEXT_LAYERS = 30  # Flux2Pipeline reads hidden states 10, 20 and 30 by default
TEXT_WIDTH = 16
LATENT_CHANNELS = 4
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# Mistral's form: the system prompt, then each user turn in [INST]; a message's content is a string or a list of parts.
# A user turn holding [INST] itself (a forged turn) is refused, as a template refuses what it cannot render: a prompt
# that only the text encoder's tokenizer refuses.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}{%- else %}"
    "{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}"
    "{%- if '[INST]' in text %}{{ raise_exception('a user turn may not hold [INST]') }}{%- endif %}"
    "{{ '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{ text + eos_token }}{%- endif %}{%- endfor %}")


def flux2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX.2's published scheduler config (the pipelines pass their own mu: the shift follows the image's tokens)."""
    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                           max_shift=1.15, shift=3.0, use_dynamic_shifting=True)


def flux2_vae() -> AutoencoderKLFlux2:
    return AutoencoderKLFlux2(block_out_channels=(4, 8, 8, 8), layers_per_block=1, latent_channels=LATENT_CHANNELS,
                              norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False, sample_size=64)


def flux2_transformer(text_dim: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    """With its attention sharpened (sharpen_attention): an input image's tokens, few beside 512 text tokens, matter."""
    model = Flux2Transformer2DModel(patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=text_dim,
                                    timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
                                    guidance_embeds=guidance_embeds)
    return sharpen_attention(model)


def tiny_flux2_klein_pipeline(seed: int = 0) -> Flux2KleinPipeline:
    """FLUX.2 [klein]'s base layout (not distilled: classifier-free guidance by a negative prompt), random weights
    drawn from seed."""
    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=KLEIN_TEXT_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=True)).eval()
    return Flux2KleinPipeline(scheduler=flux2_scheduler(), vae=flux2_vae(), text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=flux2_transformer(3 * TEXT_WIDTH, guidance_embeds=False),
                              is_distilled=False)


def mistral_tokenizer() -> PreTrainedTokenizerFast:
    """Mistral's special tokens (ids 0-10), then 256 byte tokens: a byte-level BPE without merges."""
    vocab = {token: index for index, token in enumerate(MISTRAL_SPECIALS)}
    vocab.update({token: len(vocab) + index for index, token in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=MISTRAL_SPECIALS[4:],
                                   chat_template=MISTRAL_CHAT_TEMPLATE)


def tiny_flux2_pipeline(seed: int = 0) -> Flux2Pipeline:
    """FLUX.2 [dev]'s layout (guidance distilled: the guidance scale embedded), random weights drawn from seed."""
    torch.manual_seed(seed)
    tokenizer = mistral_tokenizer()
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=32,
                         num_hidden_layers=DEV_TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, patch_size=16, image_size=64),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)).eval()
    return Flux2Pipeline(scheduler=flux2_scheduler(), vae=flux2_vae(), text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=flux2_transformer(3 * TEXT_WIDTH, guidance_embeds=True))


def save_tiny_flux2_klein_pipeline(directory: Path, seed: int = 0) -> Path:
    """Write a tiny pipeline into directory (diffusers' layout, safetensors weights) and return directory."""
    tiny_flux2_klein_pipeline(seed).save_pretrained(directory)
    return Path(directory)


def save_tiny_flux2_pipeline(directory: Path, seed: int = 0) -> Path:
    """Write a tiny pipeline into directory (diffusers' layout, safetensors weights) and return directory."""
    tiny_flux2_pipeline(seed).save_pretrained(directory)
    return Path(directory)
