"""FLUX.1 Kontext served with diffusers' own transformer ("flux-kontext-generic-pipeline"): FluxKontextPipeline, its
FluxTransformer2DModel split by sequence as diffusers declares (mdtriton.pipeline.generic), with no model code of ours.

The same request as "flux-kontext-pipeline" (mdtriton.families.flux.kontext), which serves Kontext with our FLUX engine
(tensor parallelism, FP8, the step cache, LoRA adapters); this one is the price of a model without hand-written code,
measured on the model both serve.
"""

from __future__ import annotations

from typing import Any

from mdtriton.families.flux.kontext import KontextRequest
from mdtriton.pipeline.generic import DiffusersPipelinePart


class FluxKontextGenericPipelinePart(KontextRequest, DiffusersPipelinePart):
    """FluxKontextPipeline with diffusers' FluxTransformer2DModel split by its `_cp_plan`."""

    cache_methods = ("first_block", "taylorseer")

    def cache_contexts(self, pipeline: Any, arguments: dict) -> tuple[str, ...]:
        """FluxKontextPipeline names no cache context: a guided step's calls are its conditional, then its
        unconditional one; an unguided step's one call the conditional."""
        return ("cond", "uncond") if self.guides(pipeline, arguments) else ("cond",)


FLUX_KONTEXT_GENERIC = FluxKontextGenericPipelinePart()
