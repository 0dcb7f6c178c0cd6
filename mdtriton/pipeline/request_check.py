"""Check a request to a FLUX pipeline model on the rank that received it, before any rank sees it.

Triton already refuses wrong data types, shapes and missing required inputs (config.pbtxt). Here: prompts
that are not UTF-8, sizes the VAE and the patching cannot take, a token count over the engine's limit
(naming the largest size that fits), step counts, a guidance that is not finite, a batch over the limit.
"""

from __future__ import annotations

import math

import torch

from mdtriton.engine.manifest import Manifest
from mdtriton.engine.request_check import RequestError
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.signature import MAX_SEQUENCE_LENGTH, MAX_STEPS, OPTIONAL_INPUTS


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


def _prompts(inputs: dict[str, torch.Tensor], name: str) -> list[str]:
    try:
        return read_prompts(inputs[name], name)
    except ValueError as error:
        raise RequestError(str(error)) from None


def check_pipeline_request(manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
    """Raise RequestError, saying what to send instead, if the inputs are not a request the pipeline can run."""
    missing = [spec.name for spec in manifest.inputs if spec.name not in inputs and spec.name not in OPTIONAL_INPUTS]
    if missing:
        raise RequestError(f"input(s) {missing} missing; this model takes {', '.join(s.name for s in manifest.inputs)}")
    prompts = _prompts(inputs, "prompt")
    if "prompt_2" in inputs and len(_prompts(inputs, "prompt_2")) != len(prompts):
        raise RequestError(f"prompt_2 has {inputs['prompt_2'].shape[0]} rows, prompt {len(prompts)}; send one "
                           "prompt_2 per prompt, or none")
    batch = len(prompts)
    if batch > manifest.limits.max_batch_size:
        raise RequestError(f"{batch} prompts is over this model's maximum of {manifest.limits.max_batch_size} images "
                           "per request; send fewer (the limit is set at build time: mdtriton build --max-batch-size)")
    multiple = size_multiple(manifest)
    height, width = int(inputs["height"][0]), int(inputs["width"][0])
    for name, side in (("height", height), ("width", width)):
        if side < multiple or side % multiple:
            below = side // multiple * multiple
            nearest = f"{below} or {below + multiple}" if below >= multiple else f"{multiple}"
            raise RequestError(f"{name} {side} is not a positive multiple of {multiple}; send a {name} of {nearest} "
                               f"(sides are multiples of {multiple}: the VAE's {multiple // 2}x compression times "
                               "FLUX's 2x2 patches)")
    text_tokens = int(inputs["max_sequence_length"][0]) if "max_sequence_length" in inputs else MAX_SEQUENCE_LENGTH
    if not 1 <= text_tokens <= MAX_SEQUENCE_LENGTH:
        raise RequestError(f"max_sequence_length {text_tokens} is out of range; send 1 to {MAX_SEQUENCE_LENGTH} "
                           f"(default {MAX_SEQUENCE_LENGTH})")
    tokens = image_tokens(manifest, height, width) + text_tokens
    if tokens > manifest.limits.max_tokens:
        side = largest_square(manifest, text_tokens)
        fits = f"the largest square image that fits is {side}x{side}" if side else "no image fits with that text length"
        raise RequestError(f"{height}x{width} with {text_tokens} text tokens is {tokens} tokens, over this engine's "
                           f"maximum of {manifest.limits.max_tokens}; {fits} (or send a shorter max_sequence_length; "
                           "the limit is set at build time: mdtriton build --max-tokens)")
    steps = int(inputs["num_inference_steps"][0])
    if not 1 <= steps <= MAX_STEPS:
        raise RequestError(f"num_inference_steps {steps} is out of range; send 1 to {MAX_STEPS}")
    guidance = float(inputs["guidance_scale"][0])
    if not math.isfinite(guidance):
        raise RequestError(f"guidance_scale {guidance} is not finite; send a finite number (FLUX.1-dev: 3.5)")
