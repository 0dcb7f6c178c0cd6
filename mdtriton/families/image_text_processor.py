"""Qwen-Image-Edit's text encoder processor without a video processor: transformers 5 loads Qwen2VLProcessor only
with its video processor, which needs torchvision (not importable on CPU-only hosts: PyPI's torchvision wheels for
torch 2.13 are CUDA builds), and the edit pipelines never send it a video."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor


class ImageTextProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor: transformers takes a processor's parts from its __init__'s
    parameters (ProcessorMixin.get_attributes), so this one is made and loaded of an image processor and a tokenizer
    only, and needs no torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # Qwen2VLProcessor passes (image_processor, tokenizer, video_processor) on; ProcessorMixin pairs them with
        # this class's two parts and leaves the third, None, out.
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def image_text_processor(pipeline_dir: Path) -> ImageTextProcessor:
    """The processor of a QwenImageEditPlusPipeline directory (its `processor` folder), without a video processor."""
    folder = Path(pipeline_dir) / "processor"
    return ImageTextProcessor(image_processor=AutoImageProcessor.from_pretrained(folder, local_files_only=True),
                              tokenizer=AutoTokenizer.from_pretrained(folder, local_files_only=True))
