"""A tiny random Qwen-Image pipeline (QwenImagePipeline) in diffusers' directory layout, made offline for the tests.

Every component is Qwen-Image's class at toy sizes: Qwen's tokenizer class (Qwen2Tokenizer) over a byte-level BPE
built locally with `tokenizers` (one token per UTF-8 byte, no merges) with Qwen's special tokens and a chat template
in Qwen's form; a Qwen2.5-VL text encoder (one text layer of width 16, a one-block vision tower); AutoencoderKLQwenImage
(8x in space); QwenImageTransformer2DModel (2x2 patches of latents: an image of H x W pixels, both multiples of 16, is
H/16 x W/16 image tokens) and Qwen-Image's flow-matching scheduler (dynamic, exponential shift). A 2-step 64x64 image
takes well under a second on one CPU core.

Qwen-Image-Edit-Plus (QwenImageEditPlusPipeline) adds the text encoder's processor: Qwen2VLProcessor's image processor
(at most 4 vision tokens an image) and the tokenizer, saved as a checkpoint's `processor` folder is. The pipeline
resizes every input image to a megapixel for its VAE, so its tiny VAE compresses 16x (one more level, 4 channels
throughout, no residual blocks: a 1024x1024 image is 1,024 tokens, encoded in about 2 s on a CPU); its encoder's
latents are scaled up (ENCODER_GAIN) and its transformer's attention sharpened (mdtriton.testing.tiny_flux_pipeline.
sharpen_attention), so that every input image changes the image.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline,
                       QwenImagePipeline, QwenImageTransformer2DModel)
from tokenizers import pre_tokenizers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mdtriton.families.image_text_processor import ImageTextProcessor
from mdtriton.testing.tiny_flux_pipeline import sharpen_attention

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
                 "{%- endif %}{%- endif %}")
TEXT_DIM = 16  # the text encoder's hidden size = the transformer's joint_attention_dim
# Qwen-Image-Edit-Plus's tiny VAE at random weights encodes images to latents that differ by a few hundredths; its
# encoder's last convolution is scaled by this, so that they differ by about one.
ENCODER_GAIN = 20.0


def qwen_tokenizer() -> Qwen2Tokenizer:
    """Qwen's tokenizer class (its pre-tokenizer, <|endoftext|> padding) over 256 byte tokens, then <|endoftext|> and
    the special tokens Qwen's prompt templates use: 263 ids. Bytes, not Qwen's merges, so every prompt template is
    longer than the tokens the pipelines drop from its start."""
    vocab = {token: index for index, token in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    return Qwen2Tokenizer(vocab=vocab, merges=[], additional_special_tokens=SPECIALS, chat_template=CHAT_TEMPLATE,
                          model_max_length=32768)


def qwen2_5_vl_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL at toy sizes, its vocabulary the tokenizer's and its vision tokens the tokenizer's ids."""
    image_pad, video_pad, vision_start, vision_end = tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=1e6),
                         bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_DIM,
                           fullatt_block_indexes=[0]),
        image_token_id=image_pad, video_token_id=video_pad, vision_start_token_id=vision_start,
        vision_end_token_id=vision_end)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's published scheduler config: the shift grows with the image's tokens (exponential time shift)."""
    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192,
                                           max_shift=0.9, shift=1.0, shift_terminal=0.02, use_dynamic_shifting=True,
                                           time_shift_type="exponential")


def tiny_qwen_image_parts(seed: int = 0, num_layers: int = 1) -> dict:
    """The components Qwen-Image's pipelines share (text-to-image and edit), seeded; num_layers: the transformer's
    blocks (First Block Cache needs two at least: a first and a last)."""
    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                                 latents_std=[1.5, 2.0, 1.0, 2.5])
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=num_layers,
                                              attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=TEXT_DIM, axes_dims_rope=(8, 4, 4))
    return dict(scheduler=qwen_image_scheduler(), vae=vae, text_encoder=qwen2_5_vl_text_encoder(tokenizer),
                tokenizer=tokenizer, transformer=transformer)


def tiny_qwen_image_pipeline(seed: int = 0, num_layers: int = 1) -> QwenImagePipeline:
    """Qwen-Image's text-to-image pipeline at toy sizes, its random weights drawn from seed."""
    return QwenImagePipeline(**tiny_qwen_image_parts(seed, num_layers))


def save_tiny_qwen_image_pipeline(directory: Path, seed: int = 0, num_layers: int = 1) -> Path:
    """Write a tiny pipeline into directory (diffusers' layout, safetensors weights) and return directory."""
    tiny_qwen_image_pipeline(seed, num_layers).save_pretrained(directory)
    return Path(directory)


def tiny_qwen_image_edit_plus_pipeline(seed: int = 0) -> QwenImageEditPlusPipeline:
    """Qwen-Image-Edit-Plus at toy sizes (a 16x VAE, sharpened attention), its random weights drawn from seed."""
    parts = tiny_qwen_image_parts(seed)
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0,
                                 temperal_downsample=[False, True, True, True], latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4)
    with torch.no_grad():  # the encoder's latents spread (ENCODER_GAIN), the decoder's unchanged
        vae.quant_conv.weight.mul_(ENCODER_GAIN)
        vae.quant_conv.bias.mul_(ENCODER_GAIN)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
    processor = ImageTextProcessor(image_processor=image_processor, tokenizer=parts["tokenizer"])
    return QwenImageEditPlusPipeline(**{**parts, "vae": vae, "transformer": sharpen_attention(parts["transformer"])},
                                     processor=processor)


def save_tiny_qwen_image_edit_plus_pipeline(directory: Path, seed: int = 0) -> Path:
    """Write a tiny Qwen-Image-Edit-Plus into directory as its checkpoints are laid out (save_qwen2vl_processor) and
    return directory."""
    directory = Path(directory)
    pipeline = tiny_qwen_image_edit_plus_pipeline(seed)
    pipeline.save_pretrained(directory)
    (directory / "processor" / "processor_config.json").unlink()
    save_qwen2vl_processor(directory, pipeline.processor.image_processor, pipeline.processor.tokenizer)
    return directory


def save_qwen2vl_processor(directory: Path, image_processor, tokenizer) -> None:
    """The text encoder's processor in a Qwen-Image-Edit-Plus directory as its checkpoints lay it out: model_index.json
    naming transformers' Qwen2VLProcessor, the `processor` folder holding the image processor's and the tokenizer's
    files."""
    index_path = Path(directory) / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2))
    image_processor.save_pretrained(Path(directory) / "processor")
    tokenizer.save_pretrained(Path(directory) / "processor")
