"""FLUX.2 [klein] served as one model ("flux2-klein-pipeline"): diffusers' Flux2KleinPipeline, prompt to image, its
Flux2Transformer2DModel split by sequence as diffusers declares (mdtriton.pipeline.generic). Text to image only: the
pipeline's input images (its `image`) are not served yet.

Inputs are named after `Flux2KleinPipeline.__call__` (prompts as text: Triton's BYTES, read as UTF-8 rows); its
classifier-free guidance (against the empty prompt) runs where guidance_scale is over 1 and the checkpoint is not
distilled, as in diffusers. The output is the image as UINT8; progress responses carry `step` only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mdtriton.engine.manifest import Manifest, Signature, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.pipeline.generic import DiffusersPipelinePart
from mdtriton.pipeline.part import to_uint8
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.request_checks import (check_batch, check_sides, check_steps_and_guidance, prompts_of,
                                             text_length)

# Flux2KleinPipeline's default and largest text length (its Qwen3 encoder's tokens).
MAX_SEQUENCE_LENGTH = 512


class Flux2KleinPipelinePart(DiffusersPipelinePart):
    diffusers_class = "Flux2KleinPipeline"

    def signature(self) -> Signature:
        inputs = (
            TensorSpec("prompt", "STRING", (-1,)),
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
        return {"height": 1024, "width": 1024, "num_inference_steps": 50, "guidance_scale": 4.0, "seed": 0,
                "max_sequence_length": None}

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """The VAE's scale factor (8 for FLUX.2), as Flux2KleinPipeline derives it."""
        vae_config = json.loads((Path(pipeline_dir) / "vae" / "config.json").read_text())
        return {"vae_scale_factor": 2 ** (len(vae_config["block_out_channels"]) - 1)}

    def check_request(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Prompts that are not UTF-8, sides the VAE and the 2x2 patches cannot take, a request over the token limit,
        a text length out of range, step counts, a guidance out of range, a batch over the limit."""
        prompts = prompts_of(inputs, "prompt")
        check_batch(manifest, prompts, "images")
        multiple = 2 * manifest.config["vae_scale_factor"]
        height, width = check_sides(inputs, multiple, f"sides are multiples of {multiple}: the VAE's "
                                                      f"{multiple // 2}x compression times FLUX.2's 2x2 patches")
        text_tokens = text_length(inputs, MAX_SEQUENCE_LENGTH)
        tokens = (height // multiple) * (width // multiple) + text_tokens
        if tokens > manifest.limits.max_tokens:
            raise RequestError(f"{height}x{width} with {text_tokens} text tokens is {tokens} tokens, over this model's "
                               f"maximum of {manifest.limits.max_tokens}; send a smaller size (the limit is set at "
                               "build time: mdtriton build --max-tokens)")
        check_steps_and_guidance(inputs, ("guidance_scale",), "FLUX.2 [klein]: 4.0")

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        return {
            "prompt": read_prompts(inputs["prompt"], "prompt"),
            "height": int(inputs["height"][0]),
            "width": int(inputs["width"][0]),
            "num_inference_steps": int(inputs["num_inference_steps"][0]),
            "guidance_scale": float(inputs["guidance_scale"][0]),
            "generator": torch.Generator().manual_seed(int(inputs["seed"][0])),
            "max_sequence_length": text_length(inputs, MAX_SEQUENCE_LENGTH),
        }

    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """{"image": UINT8 [batch, height, width, 3]}, rounded as diffusers' numpy_to_pil."""
        return {"image": to_uint8(result.images)}


FLUX2_KLEIN = Flux2KleinPipelinePart()
