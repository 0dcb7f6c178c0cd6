"""The checks every pipeline's requests share, each raising RequestError that says what to send instead: prompts,
the batch, image sides, the text length, step counts, finite guidance, the step cache, the adapters. A family's
PipelinePart.check_inputs calls them with its own limits and words (no diffusers needed). They run in the stub that
received the request, so a request that fails them never reaches the ranks."""

from __future__ import annotations

import json
import math

import torch

from mdtriton.engine.manifest import Manifest
from mdtriton.engine.request_check import RequestError
from mdtriton.engine.request_json import read_json
from mdtriton.engine.step_cache import CacheConfig, json_kind, read_cache
from mdtriton.lora.directory import check_name
from mdtriton.pipeline.prompts import read_prompts

MAX_STEPS = 1000
# The longest prompt taken, in UTF-8 bytes: the text encoders read only its first tokens (at most 512, in 2 to 4 KiB of
# English), and every rank tokenizes the whole text (8 MiB took 15 s).
MAX_PROMPT_BYTES = 65536
INT32_MAX = 2**31 - 1
# The accepted guidance scales and adapter scales: finite bounds far beyond any use (guidance 1 to 20, adapter scales -2
# to 2 in practice), so that a value out of them, which would make a flat or noise image, is refused.
GUIDANCE_RANGE = (0.0, 100.0)
LORA_SCALE_RANGE = (-10.0, 10.0)
# A conditioning image's largest side, and how far its aspect (width / height) may be from the video's: the pipeline
# resizes it to cover the video, to an image of (that factor) times the video's pixels at most.
MAX_IMAGE_SIDE = 4096
MAX_IMAGE_ASPECT_FACTOR = 4.0


def check_text_elements(values, name: str, most: int, limit: str) -> None:
    """RequestError, naming the input, if the BYTES elements `values` of text input `name` are more than `most` (limit:
    where that number comes from, for the message) or one is longer than MAX_PROMPT_BYTES. Read from the elements as
    received, before they become rows padded to the longest (a tensor of rows x longest bytes)."""
    if len(values) > most:
        raise RequestError(f"{name} has {len(values)} elements, over the {most} this model takes ({limit}); send at "
                           f"most {most}")
    for index, value in enumerate(values):
        if len(value) > MAX_PROMPT_BYTES:
            raise RequestError(f"{name}[{index}] is {len(value)} bytes, over the {MAX_PROMPT_BYTES} taken; the text "
                               "encoders read only a prompt's first tokens (max_sequence_length): send a shorter one")


def prompts_of(inputs: dict[str, torch.Tensor], name: str) -> list[str]:
    """The prompts of input `name` (UTF-8 rows); RequestError if it has none, if one is longer than MAX_PROMPT_BYTES,
    or if one is not UTF-8."""
    rows = inputs[name]
    if rows.shape[0] == 0:
        raise RequestError(f"{name} has no rows (shape [0]); send at least one")
    if rows.shape[1] > MAX_PROMPT_BYTES:
        lengths = (rows != 0).sum(dim=1)
        index = int(lengths.argmax())
        raise RequestError(f"{name}[{index}] is {int(lengths[index])} bytes, over the {MAX_PROMPT_BYTES} taken; the text "
                           "encoders read only a prompt's first tokens (max_sequence_length): send a shorter one")
    try:
        return read_prompts(rows, name)
    except ValueError as error:
        raise RequestError(str(error)) from None


def nearest_of(value: int, multiple: int, least: int) -> str:
    """The values nearest to value that are `least` plus a multiple of `multiple`, at least `least`, and fit INT32, as
    "A or B" (or A alone)."""
    below = max(value - least, 0) // multiple * multiple + least
    return " or ".join(str(v) for v in (below, below + multiple) if v <= INT32_MAX)


def check_batch(manifest: Manifest, prompts: list[str], outputs: str) -> None:
    """One output (`outputs`: "images", "videos") per prompt, at most the engine's batch limit."""
    if len(prompts) > manifest.limits.max_batch_size:
        raise RequestError(f"{len(prompts)} prompts is over this model's maximum of {manifest.limits.max_batch_size} "
                           f"{outputs} per request; send fewer (the limit is set at build time: mdtriton build "
                           "--max-batch-size)")


def check_sides(inputs: dict[str, torch.Tensor], multiple: int, why: str) -> tuple[int, int]:
    """(height, width), each a positive multiple of `multiple` (why: what makes it so, for the message)."""
    height, width = int(inputs["height"][0]), int(inputs["width"][0])
    for name, side in (("height", height), ("width", width)):
        if side < multiple or side % multiple:
            raise RequestError(f"{name} {side} is not a positive multiple of {multiple}; send a {name} of "
                               f"{nearest_of(side, multiple, multiple)} ({why})")
    return height, width


def check_image(image: torch.Tensor, height: int, width: int, name: str = "image") -> None:
    """A conditioning image (UINT8 [rows, columns, 3]) that the pipeline can resize to cover height x width within
    bounds: sides 1 to MAX_IMAGE_SIDE, and an aspect within MAX_IMAGE_ASPECT_FACTOR of the video's (the resized image
    has the video's pixels times the ratio of the two aspects); name: the input's, for the message."""
    rows, columns = image.shape[0], image.shape[1]
    usual = "(any size and aspect near the video's: it is resized and center-cropped to height x width)"
    if not (1 <= rows <= MAX_IMAGE_SIDE and 1 <= columns <= MAX_IMAGE_SIDE):
        raise RequestError(f"{name} has shape {list(image.shape)}; send UINT8 [height, width, 3] RGB pixels of sides 1 "
                           f"to {MAX_IMAGE_SIDE} {usual}")
    factor = max(columns * height / (rows * width), rows * width / (columns * height))
    if factor > MAX_IMAGE_ASPECT_FACTOR:
        raise RequestError(f"{name} is {columns}x{rows}: its aspect differs from the video's ({width}x{height}) by a "
                           f"factor of {factor:.1f}, over the {MAX_IMAGE_ASPECT_FACTOR:g} taken (resized to cover the "
                           f"video it would have {factor:.1f} times the video's pixels); crop it nearer the video's aspect")


def check_frames(inputs: dict[str, torch.Tensor], temporal: int, usual: str) -> int:
    """num_frames, 1 more than a multiple of the VAE's temporal compression (it compresses `temporal` frames into one
    after the first); usual: the family's typical counts, for the message."""
    frames = int(inputs["num_frames"][0])
    if frames < 1 or (frames - 1) % temporal:
        raise RequestError(f"num_frames {frames} is not {temporal}k+1; send {nearest_of(frames, temporal, 1)} (the VAE "
                           f"compresses {temporal} frames into one after the first; {usual})")
    return frames


def text_length(inputs: dict[str, torch.Tensor], longest: int) -> int:
    """The request's max_sequence_length (default and limit: longest), checked."""
    tokens = int(inputs["max_sequence_length"][0]) if "max_sequence_length" in inputs else longest
    if not 1 <= tokens <= longest:
        raise RequestError(f"max_sequence_length {tokens} is out of range; send 1 to {longest} (default {longest})")
    return tokens


def check_steps_and_guidance(inputs: dict[str, torch.Tensor], guidance_names: tuple[str, ...], example: str) -> None:
    """num_inference_steps 1 to MAX_STEPS; each guidance input that is given finite and in GUIDANCE_RANGE (example: a
    usual value)."""
    steps = int(inputs["num_inference_steps"][0])
    if not 1 <= steps <= MAX_STEPS:
        raise RequestError(f"num_inference_steps {steps} is out of range; send 1 to {MAX_STEPS}")
    low, high = GUIDANCE_RANGE
    for name in guidance_names:
        if name not in inputs:
            continue
        value = float(inputs[name][0])
        if not math.isfinite(value):
            raise RequestError(f"{name} {value} is not finite; send a finite number ({example})")
        if not low <= value <= high:
            raise RequestError(f"{name} {value:g} is out of range; send {low:g} to {high:g} ({example})")


def step_cache_of(inputs: dict[str, torch.Tensor]) -> CacheConfig | None:
    """The request's step cache: its `cache` input read (mdtriton.engine.step_cache), None without one."""
    if "cache" not in inputs:
        return None
    try:
        return read_cache(prompts_of(inputs, "cache")[0])
    except ValueError as error:
        raise RequestError(str(error)) from None


def loras_of(inputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """The request's adapters and their scales: its `loras` input, a JSON object {"NAME": scale, ...} (mdtriton.lora),
    read; {} without one."""
    if "loras" not in inputs:
        return {}
    example = 'send an object of adapter names and scales, e.g. {"style": 0.8, "detail": 0.5}'
    try:
        loras = read_json(prompts_of(inputs, "loras")[0], "loras", example)
    except ValueError as error:
        raise RequestError(str(error)) from None
    if not isinstance(loras, dict):
        raise RequestError(f"loras is {json_kind(loras)}, not a JSON object; {example}")
    for name, scale in loras.items():
        try:
            check_name(name)
        except ValueError as error:
            raise RequestError(f"loras: {error}") from None
        low, high = LORA_SCALE_RANGE
        if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
                or not low <= scale <= high):
            raise RequestError(f"loras: the scale of {name!r} is {json.dumps(scale)}; send a number from {low:g} to "
                               f"{high:g} (1.0: the adapter as trained)")
    return {name: float(scale) for name, scale in loras.items()}
