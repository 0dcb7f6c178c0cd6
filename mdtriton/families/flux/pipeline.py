"""The FLUX pipeline served as one model ("flux-pipeline"): diffusers' FluxPipeline, prompt to image.

Inputs are named after `FluxPipeline.__call__` (prompts as text: Triton's BYTES, read as UTF-8 rows: mdtriton.pipeline.prompts), the output is
the image as UINT8; progress responses carry `step` (steps finished) only. diffusers runs the pipeline (CLIP and
T5, the initial noise from a CPU generator seeded with `seed`, the scheduler loop with FLUX's resolution-dependent
shift, the VAE), so an image equals diffusers' for the same components; its transformer is our engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.families.family import PipelinePart, Signature
from mdtriton.pipeline.part import to_uint8
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.request_checks import (check_batch, check_sides, check_steps_and_guidance, prompts_of,
                                             text_length)
from mdtriton.pipeline.transformer import EngineAsTransformer

# FluxPipeline's default and largest T5 sequence length.
MAX_SEQUENCE_LENGTH = 512


class EngineTransformer(EngineAsTransformer):
    """FluxPipeline's `transformer`: a transformer engine called as FluxTransformer2DModel is.

    Guidance parallelism (cfg_size 2, FluxKontextPipeline's true classifier-free guidance): the pipeline names no
    branch, but each guided step calls the conditional branch first, then the unconditional one (run_guided); its part
    says whether a request guides (`guided`)."""

    def __init__(self, engine: TorchEngine):
        super().__init__(engine)
        config = engine.manifest.config
        self.config = SimpleNamespace(in_channels=config["in_channels"], guidance_embeds=config["guidance_embeds"])
        self.out_features = config["patch_size"] ** 2 * (config["out_channels"] or config["in_channels"])
        self.guided = False  # whether the request's steps each call the transformer twice, set before its call

    def forward(self, hidden_states, timestep, guidance, pooled_projections, encoder_hidden_states, txt_ids, img_ids,
                joint_attention_kwargs=None, return_dict=False):
        inputs = {
            "hidden_states": hidden_states.to(self._dtype),
            "encoder_hidden_states": encoder_hidden_states.to(self._dtype),
            "pooled_projections": pooled_projections.to(self._dtype),
            "timestep": timestep.to(self._dtype),
            "img_ids": img_ids.float(),
            "txt_ids": txt_ids.float(),
        }
        if self.config.guidance_embeds:
            inputs["guidance"] = guidance.to(self._dtype)
        if self.engine.comm.cfg_size == 1 or not self.guided:
            return (self.run_engine(inputs),)
        branch = "uncond" if self.pending is not None else "cond"
        return (self.run_guided(inputs, branch, (*hidden_states.shape[:2], self.out_features)),)


class FluxPipelinePart(PipelinePart):
    diffusers_class = "FluxPipeline"
    cache_methods = ("first_block", "taylorseer")

    def signature(self) -> Signature:
        inputs = (
            TensorSpec("prompt", "STRING", (-1,)),
            TensorSpec("height", "INT32", (1,)),
            TensorSpec("width", "INT32", (1,)),
            TensorSpec("num_inference_steps", "INT32", (1,)),
            TensorSpec("guidance_scale", "FP32", (1,)),
            TensorSpec("seed", "INT64", (1,)),
            TensorSpec("prompt_2", "STRING", (-1,)),
            TensorSpec("max_sequence_length", "INT32", (1,)),
        )
        outputs = (TensorSpec("image", "UINT8", (-1, -1, -1, 3)), TensorSpec("step", "INT32", (1,)))
        return inputs, outputs

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {"height": 1024, "width": 1024, "num_inference_steps": 28, "guidance_scale": 3.5, "seed": 0,
                "prompt_2": None, "max_sequence_length": None}

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """The VAE's scale factor (8 for FLUX.1), as FluxPipeline derives it."""
        vae_config = json.loads((Path(pipeline_dir) / "vae" / "config.json").read_text())
        return {"vae_scale_factor": 2 ** (len(vae_config["block_out_channels"]) - 1)}

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Prompts that are not UTF-8, sizes the VAE and the patching cannot take, a token count over the engine's
        limit (naming the largest size that fits), step counts, a guidance that is not finite, a batch over the
        limit."""
        prompts = prompts_of(inputs, "prompt")
        if "prompt_2" in inputs and len(prompts_of(inputs, "prompt_2")) != len(prompts):
            raise RequestError(f"prompt_2 has {inputs['prompt_2'].shape[0]} rows, prompt {len(prompts)}; send one "
                               "prompt_2 per prompt, or none")
        check_batch(manifest, prompts, "images")
        multiple = size_multiple(manifest)
        height, width = check_sides(inputs, multiple, f"sides are multiples of {multiple}: the VAE's "
                                                      f"{multiple // 2}x compression times FLUX's 2x2 patches")
        text_tokens = text_length(inputs, MAX_SEQUENCE_LENGTH)
        tokens = image_tokens(manifest, height, width) + text_tokens
        if tokens > manifest.limits.max_tokens:
            side = largest_square(manifest, text_tokens)
            fits = (f"the largest square image that fits is {side}x{side}" if side
                    else "no image fits with that text length")
            raise RequestError(f"{height}x{width} with {text_tokens} text tokens is {tokens} tokens, over this "
                               f"engine's maximum of {manifest.limits.max_tokens}; {fits} (or send a shorter "
                               "max_sequence_length; the limit is set at build time: mdtriton build --max-tokens)")
        check_steps_and_guidance(inputs, ("guidance_scale",), "FLUX.1-dev: 3.5")

    def request_tokens(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> int:
        """Image tokens plus text tokens, as check_request counts them against the engine's limit."""
        return (image_tokens(manifest, int(inputs["height"][0]), int(inputs["width"][0]))
                + text_length(inputs, MAX_SEQUENCE_LENGTH))

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        return {
            "prompt": read_prompts(inputs["prompt"], "prompt"),
            "prompt_2": read_prompts(inputs["prompt_2"], "prompt_2") if "prompt_2" in inputs else None,
            "height": int(inputs["height"][0]),
            "width": int(inputs["width"][0]),
            "num_inference_steps": int(inputs["num_inference_steps"][0]),
            "guidance_scale": float(inputs["guidance_scale"][0]),
            "generator": torch.Generator().manual_seed(int(inputs["seed"][0])),
            "max_sequence_length": text_length(inputs, MAX_SEQUENCE_LENGTH),
        }

    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """{"image": UINT8 [batch, height, width, 3]}."""
        return {"image": to_uint8(result.images)}

    def transformer(self, engine: TorchEngine, pipeline: Any) -> torch.nn.Module:
        return EngineTransformer(engine)


def size_multiple(manifest: Manifest) -> int:
    """Image sides must be multiples of this: the VAE's compression times FLUX's 2x2 patches."""
    return 2 * manifest.config["vae_scale_factor"]


def image_tokens(manifest: Manifest, height: int, width: int) -> int:
    multiple = size_multiple(manifest)
    return (height // multiple) * (width // multiple)


def largest_square(manifest: Manifest, text_tokens: int) -> int:
    """The largest square side (pixels) whose image tokens plus text_tokens fit the engine's token limit."""
    room = manifest.limits.max_tokens - text_tokens
    return math.isqrt(max(room, 0)) * size_multiple(manifest)

