"""Family "flux": FLUX.1 (diffusers' FluxTransformer2DModel), tensor-parallel by heads and context-parallel by
tokens of the joint [text; image] sequence, with FP8 weights on GPUs; and its whole pipelines ("flux-pipeline",
diffusers' FluxPipeline: prompt to image; "flux-kontext-pipeline", FluxKontextPipeline: a prompt and an input image to
an image)."""

from __future__ import annotations

import copy

import torch

from mdtriton.engine.manifest import TensorSpec
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.family import Family, RequestSize, Signature
from mdtriton.families.flux.kontext import FLUX_KONTEXT
from mdtriton.families.flux.pipeline import FluxPipelinePart
from mdtriton.families.flux.transformer import (
    FLUX_80B_CONFIG,
    FLUX_DEV_CONFIG,
    TINY_CONFIG,
    Flux,
    check_plan,
    example_inputs,
)

# The warm-up requests' (batch, text tokens, image tokens), in order: batch 7 first, whose graphs serve every batch
# of 2 or more and any length, then batch 1 (a size-1 dimension is always specialised), whose graphs serve any
# length. Every size is prime, so that none equals a model dimension (heads per rank, say): Dynamo would take two
# equal sizes for one and specialise the request's to the model's. Batch-1 graphs, which serve most requests, are
# tuned for the sizes they first see, so theirs are a typical request's (1024x1024: 4,096 + 512 tokens).
WARM_UP_SHAPES = ((7, 127, 1021), (1, 509, 4093))
# A typical request's text tokens (FluxPipeline's default max_sequence_length) and its share of a short sequence.
TEXT_TOKENS = 512
TEXT_SHARE = 1 / 9  # 512 of 4,608 at 1024x1024
# Pixels along a side per image token: FLUX.1's VAE compresses 8x, then 2x2 latents are packed into one token.
PIXELS_PER_TOKEN = 16


class FluxFamily(Family):
    name = "flux"
    description = "FLUX.1 transformer (diffusers' FluxTransformer2DModel): tp, cp, tp x cp; FP8 on GPUs"
    module_class = Flux
    supports_fp8 = True
    pipeline = FluxPipelinePart()
    more_pipelines = {"flux-kontext-pipeline": FLUX_KONTEXT}

    def presets(self) -> dict[str, dict]:
        return {"tiny": copy.deepcopy(TINY_CONFIG), "flux.1-dev": copy.deepcopy(FLUX_DEV_CONFIG),
                "flux-80b": copy.deepcopy(FLUX_80B_CONFIG)}

    def check_plan(self, config: dict, plan: ParallelPlan) -> None:
        check_plan(config, plan)

    def signature(self, config: dict, data_type: str) -> Signature:
        """Inputs and outputs as diffusers' forward; position ids are FP32 (diffusers turns them to float32)."""
        axes = len(config["axes_dims_rope"])
        inputs = [
            TensorSpec("hidden_states", data_type, (-1, -1, config["in_channels"])),
            TensorSpec("encoder_hidden_states", data_type, (-1, -1, config["joint_attention_dim"])),
            TensorSpec("pooled_projections", data_type, (-1, config["pooled_projection_dim"])),
            TensorSpec("timestep", data_type, (-1,)),
        ]
        if config["guidance_embeds"]:
            inputs.append(TensorSpec("guidance", data_type, (-1,)))
        inputs += [TensorSpec("img_ids", "FP32", (-1, axes)), TensorSpec("txt_ids", "FP32", (-1, axes))]
        out_channels = config["out_channels"] or config["in_channels"]
        outputs = (TensorSpec("sample", data_type, (-1, -1, config["patch_size"] ** 2 * out_channels)),)
        return tuple(inputs), outputs

    def request_size(self, config: dict, inputs: dict[str, torch.Tensor]) -> RequestSize:
        """Text + image tokens; ValueError if the inputs disagree on the batch or the token counts."""
        batch, image_len = inputs["hidden_states"].shape[:2]
        text_len = inputs["encoder_hidden_states"].shape[1]
        per_sample = ["encoder_hidden_states", "pooled_projections", "timestep"]
        per_sample += ["guidance"] if config["guidance_embeds"] else []
        for name in per_sample:
            if inputs[name].shape[0] != batch:
                raise ValueError(f"{name} has batch size {inputs[name].shape[0]} but hidden_states has {batch}; "
                                 "every per-sample input needs the same batch size")
        for ids, tokens, kind, length in (("img_ids", "hidden_states", "image", image_len),
                                          ("txt_ids", "encoder_hidden_states", "text", text_len)):
            if inputs[ids].shape[0] != length:
                raise ValueError(f"{ids} has {inputs[ids].shape[0]} rows but {tokens} has {length} {kind} tokens; "
                                 f"give one position-id row per {kind} token")
        return RequestSize(batch, text_len + image_len)

    def warm_up_requests(self, config: dict, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        return [example_inputs(config, text, image, dtype, batch) for batch, text, image in WARM_UP_SHAPES]

    def example_request(self, config: dict, tokens: int, dtype: torch.dtype,
                        batch: int = 1) -> dict[str, torch.Tensor]:
        """512 text tokens and the rest image, as at 1024x1024 (a ninth of a shorter sequence is text)."""
        text = max(1, min(TEXT_TOKENS, round(tokens * TEXT_SHARE)))
        return example_inputs(config, text, tokens - text, dtype, batch)

    def media_request(self, config: dict, frames: int, height: int, width: int,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """FluxPipeline's: a token per 16x16 pixels, image ids on the image's grid, 512 text tokens."""
        if frames != 1:
            raise ValueError(f"FLUX makes images, not {frames} frames; ask for 1 frame")
        for name, side in (("height", height), ("width", width)):
            if side < PIXELS_PER_TOKEN or side % PIXELS_PER_TOKEN:
                raise ValueError(f"{name} {side} is not a positive multiple of {PIXELS_PER_TOKEN} (FLUX's VAE "
                                 "compresses 8x, then 2x2 patches); send a multiple of 16")
        rows, columns = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
        return example_inputs(config, TEXT_TOKENS, rows * columns, dtype, columns=columns)


FLUX = FluxFamily()
