"""Input images, the one convention of every image pipeline that takes them (reference images to edit or to follow):
up to three request inputs `image`, `image_2`, `image_3`, each UINT8 [height, width, 3] RGB pixels, the first one
first. A pipeline declares them (image_specs; its optional_inputs say whether `image` is required) and checks them
before the job is ordered (check_images: RequestError naming the input and what to send); they reach the diffusers
pipeline as the PIL images diffusers' examples give it (pil_images), so a served image equals diffusers' given the
same PIL images."""

from __future__ import annotations

import PIL.Image
import torch

from mdtriton.engine.manifest import TensorSpec
from mdtriton.engine.request_check import RequestError

IMAGE_INPUTS = ("image", "image_2", "image_3")
# The sides an input image may have: the pipelines resize every input image to about a megapixel (FLUX.2 those over
# it, Qwen-Image-Edit all of them), so a larger one is only more bytes to send and to resize.
MAX_INPUT_SIDE = 4096


def image_specs() -> tuple[TensorSpec, ...]:
    """The input images' request inputs, as a pipeline's signature declares them."""
    return tuple(TensorSpec(name, "UINT8", (-1, -1, 3)) for name in IMAGE_INPUTS)


def check_images(inputs: dict[str, torch.Tensor], smallest_side: int, largest_aspect: float, pipeline: str) -> None:
    """The request's input images in order (no `image_2` without `image`), each with sides smallest_side to
    MAX_INPUT_SIDE and its long side at most largest_aspect times its short one (pipeline: its name, for the
    messages). Triton itself refuses an input image of another data type, rank or channel count, one the pipeline does
    not declare, and a required one left out (config.pbtxt), naming the input."""
    given = [name for name in IMAGE_INPUTS if name in inputs]
    for index, name in enumerate(given):
        if name != IMAGE_INPUTS[index]:
            raise RequestError(f"{name} is sent without {IMAGE_INPUTS[index]}; input images fill image, image_2, "
                               f"image_3 in order: send {IMAGE_INPUTS[index]} first")
    for name in given:
        rows, columns = inputs[name].shape[0], inputs[name].shape[1]
        if not (smallest_side <= rows <= MAX_INPUT_SIDE and smallest_side <= columns <= MAX_INPUT_SIDE):
            raise RequestError(f"{name} is {columns}x{rows} pixels; send sides {smallest_side} to {MAX_INPUT_SIDE} "
                               "(UINT8 [height, width, 3] RGB pixels)")
        aspect = max(rows, columns) / min(rows, columns)
        if aspect > largest_aspect:
            raise RequestError(f"{name} is {columns}x{rows} pixels, an aspect of {aspect:.1f}:1, over the "
                               f"{largest_aspect:g}:1 {pipeline} takes; crop it nearer to square")


def pil_images(inputs: dict[str, torch.Tensor]) -> list[PIL.Image.Image]:
    """The request's input images, in order, as RGB PIL images (what diffusers' image pipelines take)."""
    return [PIL.Image.fromarray(inputs[name].cpu().numpy(), "RGB") for name in IMAGE_INPUTS if name in inputs]
