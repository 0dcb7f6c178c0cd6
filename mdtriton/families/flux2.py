"""FLUX.2 served as one model: diffusers' Flux2Pipeline (FLUX.2 [dev], "flux2-pipeline") and, by the same request,
Flux2KleinPipeline (FLUX.2 [klein], "flux2-klein-pipeline"); prompt to image, or prompt and up to three
reference images (`image`, `image_2`, `image_3`: mdtriton.pipeline.image_inputs) to an edited image; their
Flux2Transformer2DModel split by sequence as diffusers declares (mdtriton.pipeline.generic).

Inputs are named after `Flux2Pipeline.__call__` (prompts as text: Triton's BYTES, read as UTF-8 rows). [dev] embeds
its guidance_scale in the transformer (guidance distilled); [klein] runs classifier-free guidance (against the empty
prompt) where guidance_scale is over 1 and the checkpoint is not distilled, as in diffusers. The size left out is the
first input image's (cut to multiples of 16, after a larger one is scaled to a megapixel), else 1024x1024, as in
diffusers. Each input image's tokens are appended to the image's, so they count against the model's token limit. The
output is the image as UINT8; progress responses carry `step` only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mdtriton.engine.manifest import Manifest, Signature, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.pipeline.generic import DiffusersPipelinePart
from mdtriton.pipeline.image_inputs import IMAGE_INPUTS, check_images, image_specs, pil_images
from mdtriton.pipeline.part import to_uint8
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.request_checks import (check_batch, check_sides, check_steps_and_guidance, prompts_of,
                                             text_length)

# The pipelines' default and largest text length (their text encoder's tokens).
MAX_SEQUENCE_LENGTH = 512
# What the pipelines take of an input image (Flux2ImageProcessor.check_image_input): sides of 64 pixels at least, an
# aspect up to 8:1; one over a megapixel is scaled to a megapixel.
SMALLEST_INPUT_SIDE = 64
LARGEST_INPUT_ASPECT = 8.0
INPUT_AREA = 1024 * 1024
DEFAULT_SIDE = 1024


class Flux2PipelinePart(DiffusersPipelinePart):
    diffusers_class = "Flux2Pipeline"
    model_name = "FLUX.2 [dev]"
    cache_methods = ("taylorseer",)
    cache_note = ("diffusers' First Block Cache fails on Flux2Transformer2DModel: it takes the head block's output "
                  "(a double block's, image and text apart) from the tail block's (a single block's, one joint stream)")
    # Its 24 B text encoder (Mistral Small 3.1, 44.7 GiB in bf16) runs once per request: on rank 0 only, its 15 MiB
    # of prompt embeddings broadcast (mdtriton.pipeline.encoder).
    one_rank_components = ("text_encoder",)

    def signature(self) -> Signature:
        inputs = (
            TensorSpec("prompt", "STRING", (-1,)),
            *image_specs(),
            TensorSpec("height", "INT32", (1,)),
            TensorSpec("width", "INT32", (1,)),
            TensorSpec("num_inference_steps", "INT32", (1,)),
            TensorSpec("guidance_scale", "FP32", (1,)),
            TensorSpec("seed", "INT64", (1,)),
            TensorSpec("max_sequence_length", "INT32", (1,)),
        )
        outputs = (TensorSpec("image", "UINT8", (-1, -1, -1, 3)), TensorSpec("step", "INT32", (1,)))
        return inputs, outputs

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {**dict.fromkeys(IMAGE_INPUTS), "height": None, "width": None, "num_inference_steps": 50,
                "guidance_scale": 4.0, "seed": 0, "max_sequence_length": None}

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """The VAE's scale factor (8 for FLUX.2), as the pipelines derive it."""
        vae_config = json.loads((Path(pipeline_dir) / "vae" / "config.json").read_text())
        return {"vae_scale_factor": 2 ** (len(vae_config["block_out_channels"]) - 1)}

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Prompts that are not UTF-8, input images out of order or of sides or aspects the pipeline refuses, sides
        the VAE and the 2x2 patches cannot take, a request over the token limit (the image's, the input images' and the
        text's tokens), a text length out of range, step counts, a guidance out of range, a batch over the limit."""
        prompts = prompts_of(inputs, "prompt")
        check_batch(manifest, prompts, "images")
        check_images(inputs, SMALLEST_INPUT_SIDE, LARGEST_INPUT_ASPECT, self.model_name)
        multiple = 2 * manifest.config["vae_scale_factor"]
        input_sides = [cut_sides(inputs[name], multiple) for name in IMAGE_INPUTS if name in inputs]
        default = input_sides[0] if input_sides else (DEFAULT_SIDE, DEFAULT_SIDE)
        height, width = check_sides({"height": inputs.get("height", [default[0]]),
                                     "width": inputs.get("width", [default[1]])}, multiple,
                                    f"sides are multiples of {multiple}: the VAE's {multiple // 2}x compression times "
                                    "FLUX.2's 2x2 patches")
        text_tokens = text_length(inputs, MAX_SEQUENCE_LENGTH)
        input_tokens = sum((rows // multiple) * (columns // multiple) for rows, columns in input_sides)
        tokens = (height // multiple) * (width // multiple) + input_tokens + text_tokens
        if tokens > manifest.limits.max_tokens:
            raise RequestError(f"{height}x{width} with {len(input_sides)} input images ({input_tokens} tokens) and "
                               f"{text_tokens} text tokens is {tokens} tokens, over this model's maximum of "
                               f"{manifest.limits.max_tokens}; send a smaller size or fewer input images (the limit is "
                               "set at build time: mdtriton build --max-tokens)")
        check_steps_and_guidance(inputs, ("guidance_scale",), f"{self.model_name}: 4.0")

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        images = pil_images(inputs)
        return {
            "prompt": read_prompts(inputs["prompt"], "prompt"),
            "image": images or None,
            "height": int(inputs["height"][0]) if "height" in inputs else None,
            "width": int(inputs["width"][0]) if "width" in inputs else None,
            "num_inference_steps": int(inputs["num_inference_steps"][0]),
            "guidance_scale": float(inputs["guidance_scale"][0]),
            "generator": torch.Generator().manual_seed(int(inputs["seed"][0])),
            "max_sequence_length": text_length(inputs, MAX_SEQUENCE_LENGTH),
        }

    def cache_contexts(self, pipeline: Any, arguments: dict) -> tuple[str, ...] | None:
        """Flux2Pipeline names no cache context: its one call a step (guidance distilled) is the conditional one."""
        return ("cond",)

    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """{"image": UINT8 [batch, height, width, 3]}, rounded as diffusers' numpy_to_pil."""
        return {"image": to_uint8(result.images)}


def cut_sides(image: torch.Tensor, multiple: int) -> tuple[int, int]:
    """The (height, width) the pipelines give an input image: scaled to INPUT_AREA if it is larger (as
    Flux2ImageProcessor._resize_to_target_area rounds), then cut to multiples of `multiple`."""
    rows, columns = image.shape[0], image.shape[1]
    if rows * columns > INPUT_AREA:
        scale = math.sqrt(INPUT_AREA / (rows * columns))
        rows, columns = int(rows * scale), int(columns * scale)
    return rows // multiple * multiple, columns // multiple * multiple


class Flux2KleinPipelinePart(Flux2PipelinePart):
    diffusers_class = "Flux2KleinPipeline"
    model_name = "FLUX.2 [klein]"
    one_rank_components = ()  # its text encoder (4 B or 8 B) stays on every rank, not measured on one
    guidance_branches = True

    def cache_contexts(self, pipeline: Any, arguments: dict) -> None:
        """Flux2KleinPipeline names its calls' cache contexts ("cond", "uncond")."""
        return None

    def guides(self, pipeline: Any, arguments: dict) -> bool:
        """As Flux2KleinPipeline decides: guidance_scale over 1 and a checkpoint not guidance distilled."""
        return arguments["guidance_scale"] > 1 and not pipeline.config.is_distilled


FLUX2 = Flux2PipelinePart()
FLUX2_KLEIN = Flux2KleinPipelinePart()
