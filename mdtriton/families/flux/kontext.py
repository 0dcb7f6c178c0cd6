"""FLUX.1 Kontext served as one model ("flux-kontext-pipeline"): diffusers' FluxKontextPipeline, a prompt and an
optional input image to an image, its transformer our FLUX engine.

Kontext runs FLUX.1's transformer on the image being made and the input image's latent tokens appended after it (their
position ids' first coordinate 1): the engine takes that longer image sequence as any other (mdtriton.families.flux:
the joint [text; image] sequence is split across the context-parallel ranks whatever its length, padded at its end
where it does not divide). Without an image, Kontext makes an image from the prompt alone.

The request (`KontextRequest`) is declared once for both ways Kontext is served: here, and with diffusers' own
transformer split by its plan (mdtriton.families.flux_kontext_generic). Inputs are named after
`FluxKontextPipeline.__call__`, with two choices of ours, each documented in docs/client.md: the input image is used at
its own size, each side rounded down to a multiple of 16 (diffusers resizes it to the trained resolution nearest its
aspect unless told `_auto_resize=False`: send it at one, such as 1024x1024), and the image made is height x width
(diffusers keeps their aspect at a 1024x1024 area: here the area is theirs); left out, they are the input image's
size, or 1024x1024 without one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from mdtriton.engine.manifest import Manifest, Signature, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.families.flux.pipeline import MAX_SEQUENCE_LENGTH, FluxPipelinePart
from mdtriton.pipeline.part import to_uint8
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.request_checks import (MAX_IMAGE_SIDE, check_batch, check_steps_and_guidance, nearest_of,
                                             prompts_of, text_length)

# The image made when a request gives neither a size nor an input image (FluxKontextPipeline's default).
DEFAULT_SIDE = 1024


class KontextRequest:
    """FluxKontextPipeline's request: its inputs, defaults, checks and call. Mixed into a PipelinePart, whose
    manifest config holds the VAE's scale factor (pipeline_config)."""

    diffusers_class = "FluxKontextPipeline"
    guidance_branches = True  # true classifier-free guidance: a conditional, then an unconditional call per step

    def signature(self) -> Signature:
        inputs = (
            TensorSpec("prompt", "STRING", (-1,)),
            TensorSpec("image", "UINT8", (-1, -1, 3)),
            TensorSpec("height", "INT32", (1,)),
            TensorSpec("width", "INT32", (1,)),
            TensorSpec("num_inference_steps", "INT32", (1,)),
            TensorSpec("guidance_scale", "FP32", (1,)),
            TensorSpec("seed", "INT64", (1,)),
            TensorSpec("prompt_2", "STRING", (-1,)),
            TensorSpec("negative_prompt", "STRING", (-1,)),
            TensorSpec("true_cfg_scale", "FP32", (1,)),
            TensorSpec("max_sequence_length", "INT32", (1,)),
        )
        outputs = (TensorSpec("image", "UINT8", (-1, -1, -1, 3)), TensorSpec("step", "INT32", (1,)))
        return inputs, outputs

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {"image": None, "height": None, "width": None, "num_inference_steps": 28, "guidance_scale": 3.5,
                "seed": 0, "prompt_2": None, "negative_prompt": None, "true_cfg_scale": 1.0,
                "max_sequence_length": None}

    def pipeline_config(self, pipeline_dir) -> dict:
        """The VAE's scale factor (8 for FLUX.1), as FluxKontextPipeline derives it."""
        return FluxPipelinePart.pipeline_config(self, pipeline_dir)

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Prompts that are not UTF-8 or whose rows disagree, an input image of sides out of bounds, sizes the VAE and
        the patching cannot take, a token count (text, the image made, the input image) over the engine's limit, step
        counts, guidance out of range, a batch over the limit."""
        prompts = prompts_of(inputs, "prompt")
        for name in ("prompt_2", "negative_prompt"):
            if name in inputs and len(prompts_of(inputs, name)) != len(prompts):
                raise RequestError(f"{name} has {inputs[name].shape[0]} rows, prompt {len(prompts)}; send one {name} "
                                   "per prompt, or none")
        check_batch(manifest, prompts, "images")
        multiple = 2 * manifest.config["vae_scale_factor"]
        if "image" in inputs:
            check_edit_image(inputs["image"], multiple)
        height, width = output_size(inputs, multiple)
        text_tokens = text_length(inputs, MAX_SEQUENCE_LENGTH)
        tokens = self.request_tokens(manifest, inputs)
        input_tokens = tokens - text_tokens - (height // multiple) * (width // multiple)
        if tokens > manifest.limits.max_tokens:
            raise RequestError(f"{height}x{width} with {text_tokens} text tokens and an input image of {input_tokens} "
                               f"tokens is {tokens} tokens, over this model's maximum of {manifest.limits.max_tokens}; "
                               "send a smaller size or input image, or a shorter max_sequence_length (the limit is set "
                               "at build time: mdtriton build --max-tokens)")
        check_steps_and_guidance(inputs, ("guidance_scale", "true_cfg_scale"), "FLUX.1 Kontext [dev]: guidance_scale "
                                                                             "2.5 to 3.5")

    def request_tokens(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> int:
        """Text tokens, the image made's and the input image's (if any)."""
        multiple = 2 * manifest.config["vae_scale_factor"]
        height, width = output_size(inputs, multiple)
        tokens = text_length(inputs, MAX_SEQUENCE_LENGTH) + (height // multiple) * (width // multiple)
        if "image" in inputs:
            tokens += (inputs["image"].shape[0] // multiple) * (inputs["image"].shape[1] // multiple)
        return tokens

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        height, width = output_size(inputs, 2 * manifest.config["vae_scale_factor"])
        arguments = {
            "prompt": read_prompts(inputs["prompt"], "prompt"),
            "prompt_2": read_prompts(inputs["prompt_2"], "prompt_2") if "prompt_2" in inputs else None,
            "negative_prompt": (read_prompts(inputs["negative_prompt"], "negative_prompt")
                                if "negative_prompt" in inputs else None),
            "true_cfg_scale": float(inputs["true_cfg_scale"][0]),
            # Kontext keeps height and width's aspect at max_area pixels: at their own area it makes height x width.
            "height": height, "width": width, "max_area": height * width,
            "num_inference_steps": int(inputs["num_inference_steps"][0]),
            "guidance_scale": float(inputs["guidance_scale"][0]),
            "generator": torch.Generator().manual_seed(int(inputs["seed"][0])),
            "max_sequence_length": text_length(inputs, MAX_SEQUENCE_LENGTH),
        }
        if "image" in inputs:
            # As a PIL image, as diffusers' users give it; at its own size (rounded down to the patches' multiple).
            arguments["image"] = Image.fromarray(np.ascontiguousarray(inputs["image"].cpu().numpy()))
            arguments["_auto_resize"] = False
        return arguments

    def guides(self, pipeline: Any, arguments: dict) -> bool:
        """As FluxKontextPipeline decides: true_cfg_scale over 1 with a negative prompt."""
        return arguments["true_cfg_scale"] > 1 and arguments["negative_prompt"] is not None

    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """{"image": UINT8 [batch, height, width, 3]}, rounded as diffusers' numpy_to_pil."""
        return {"image": to_uint8(result.images)}


def check_edit_image(image: torch.Tensor, multiple: int) -> tuple[int, int]:
    """The (rows, columns) of an input image to edit (UINT8 [rows, columns, 3]: Triton refuses another type or shape
    by the signature) of sides `multiple` to MAX_IMAGE_SIDE (it is used at its size, each side rounded down to a
    multiple of `multiple`); RequestError otherwise."""
    rows, columns = image.shape[0], image.shape[1]
    if not (multiple <= rows <= MAX_IMAGE_SIDE and multiple <= columns <= MAX_IMAGE_SIDE):
        raise RequestError(f"image is {columns}x{rows} pixels; send sides {multiple} to {MAX_IMAGE_SIDE} (it is used "
                           f"at its size, each side rounded down to a multiple of {multiple}; Kontext was trained at "
                           "about 1024x1024)")
    return rows, columns


def output_size(inputs: dict[str, torch.Tensor], multiple: int) -> tuple[int, int]:
    """(height, width) of the image made: as sent, each a positive multiple of `multiple`; a side left out is the
    input image's (rounded down to that multiple), or DEFAULT_SIDE without one."""
    sides = []
    for name, axis in (("height", 0), ("width", 1)):
        if name in inputs:
            side = int(inputs[name][0])
            if side < multiple or side % multiple or side > MAX_IMAGE_SIDE:
                raise RequestError(f"{name} {side} is not a multiple of {multiple} from {multiple} to "
                                   f"{MAX_IMAGE_SIDE}; send {nearest_of(min(side, MAX_IMAGE_SIDE), multiple, multiple)} "
                                   f"(the VAE's {multiple // 2}x compression times FLUX's 2x2 patches)")
        elif "image" in inputs:
            side = inputs["image"].shape[axis] // multiple * multiple
        else:
            side = DEFAULT_SIDE
        sides.append(side)
    return sides[0], sides[1]


class FluxKontextPipelinePart(KontextRequest, FluxPipelinePart):
    """FluxKontextPipeline with our FLUX engine as its transformer (called as FluxPipeline calls it)."""

    def before_call(self, pipeline: Any, arguments: dict) -> None:
        """Tell the engine's transformer whether this call guides (guidance parallelism), with no conditional call
        pending (a failed request's)."""
        pipeline.transformer.guided = self.guides(pipeline, arguments)
        pipeline.transformer.pending = None


FLUX_KONTEXT = FluxKontextPipelinePart()
