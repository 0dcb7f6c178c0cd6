"""Qwen-Image served as one model ("qwen-image-pipeline"): diffusers' QwenImagePipeline, prompt to image, its
QwenImageTransformer2DModel split by sequence as diffusers declares (mdtriton.pipeline.generic).

Inputs are named after `QwenImagePipeline.__call__` (prompts as text: Triton's BYTES, read as UTF-8 rows); its true
classifier-free guidance runs when a negative prompt is sent and true_cfg_scale is over 1, as in diffusers. The output
is the image as UINT8; progress responses carry `step` only.
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
from mdtriton.pipeline.request_checks import check_batch, check_sides, check_steps_and_guidance, prompts_of

# The image tokens a request may ask for: 2,048 x 2,048 pixels (Qwen-Image's published sizes reach 1,664 x 928).
MAX_IMAGE_TOKENS = 128 * 128


class QwenImagePipelinePart(DiffusersPipelinePart):
    diffusers_class = "QwenImagePipeline"
    guidance_branches = True
    cache_methods = ("first_block", "taylorseer")

    def signature(self) -> Signature:
        inputs = (
            TensorSpec("prompt", "STRING", (-1,)),
            TensorSpec("negative_prompt", "STRING", (-1,)),
            TensorSpec("height", "INT32", (1,)),
            TensorSpec("width", "INT32", (1,)),
            TensorSpec("num_inference_steps", "INT32", (1,)),
            TensorSpec("true_cfg_scale", "FP32", (1,)),
            TensorSpec("seed", "INT64", (1,)),
        )
        outputs = (TensorSpec("image", "UINT8", (-1, -1, -1, 3)), TensorSpec("step", "INT32", (1,)))
        return inputs, outputs

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {"negative_prompt": None, "height": 1024, "width": 1024, "num_inference_steps": 50,
                "true_cfg_scale": 4.0, "seed": 0}

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """The VAE's scale factor (8 for Qwen-Image), as QwenImagePipeline derives it, and the fewest steps its
        scheduler takes: with a terminal shift (Qwen-Image's), one step divides by zero (NaN latents in diffusers)."""
        vae_config = json.loads((Path(pipeline_dir) / "vae" / "config.json").read_text())
        scheduler_config = json.loads((Path(pipeline_dir) / "scheduler" / "scheduler_config.json").read_text())
        return {"vae_scale_factor": 2 ** len(vae_config["temperal_downsample"]),
                "min_steps": 2 if scheduler_config.get("shift_terminal") else 1}

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Prompts that are not UTF-8, a negative prompt per prompt or none, sides the VAE and the 2x2 patches cannot
        take or over the largest size, step counts (at least min_steps), a true_cfg_scale out of range, a batch over
        the limit."""
        prompts = prompts_of(inputs, "prompt")
        if "negative_prompt" in inputs and len(prompts_of(inputs, "negative_prompt")) != len(prompts):
            raise RequestError(f"negative_prompt has {inputs['negative_prompt'].shape[0]} rows, prompt {len(prompts)}; "
                               "send one negative_prompt per prompt, or none")
        check_batch(manifest, prompts, "images")
        multiple = 2 * manifest.config["vae_scale_factor"]
        height, width = check_sides(inputs, multiple, f"sides are multiples of {multiple}: the VAE's "
                                                      f"{multiple // 2}x compression times Qwen-Image's 2x2 patches")
        if (height // multiple) * (width // multiple) > MAX_IMAGE_TOKENS:
            raise RequestError(f"{height}x{width} is over the largest image this model makes ({MAX_IMAGE_TOKENS} "
                               f"patches of {multiple}x{multiple} pixels: 2048x2048); send a smaller size")
        check_steps_and_guidance(inputs, ("true_cfg_scale",), "Qwen-Image: 4.0")
        if int(inputs["num_inference_steps"][0]) < manifest.config["min_steps"]:
            raise RequestError(f"num_inference_steps {int(inputs['num_inference_steps'][0])} is too few for this "
                               f"pipeline's scheduler (its terminal shift); send {manifest.config['min_steps']} or more")

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        return {
            "prompt": read_prompts(inputs["prompt"], "prompt"),
            "negative_prompt": (read_prompts(inputs["negative_prompt"], "negative_prompt")
                                if "negative_prompt" in inputs else None),
            "height": int(inputs["height"][0]),
            "width": int(inputs["width"][0]),
            "num_inference_steps": int(inputs["num_inference_steps"][0]),
            "true_cfg_scale": float(inputs["true_cfg_scale"][0]),
            "generator": torch.Generator().manual_seed(int(inputs["seed"][0])),
        }

    def guides(self, pipeline: Any, arguments: dict) -> bool:
        """As QwenImagePipeline decides: true_cfg_scale over 1 with a negative prompt."""
        return arguments["true_cfg_scale"] > 1 and arguments["negative_prompt"] is not None

    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """{"image": UINT8 [batch, height, width, 3]}, rounded as diffusers' numpy_to_pil."""
        return {"image": to_uint8(result.images)}


QWEN_IMAGE = QwenImagePipelinePart()
