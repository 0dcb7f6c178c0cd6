"""What a model family declares, once, for the build, the load and the server to use.

A family is a diffusers transformer (FLUX, the tiny test transformer, a user's own) split rank by rank:
`Family` says how its module is built and configured, which plans can split it, what a request to its
transformer engine looks like and how big it is, and what warms it up. A family that serves a whole diffusers
pipeline (prompt in, image or video out) adds a `PipelinePart` (mdtriton.pipeline.part). Families are registered by
name (mdtriton.families); an engine's manifest names its architecture: the family's name for its transformer engine,
`<name>-pipeline` for its pipeline.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from mdtriton.engine.architecture import Architecture, RequestSize
from mdtriton.engine.manifest import DEFAULT_MAX_TOKENS, Signature
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.part import PipelinePart

__all__ = ["AttentionShape", "Family", "PipelinePart", "RequestSize", "Signature"]  # what a family's modules import from here


@dataclass(frozen=True)
class AttentionShape:
    """The attention a forward runs, as benchmarks count it: layers that attend over the whole sequence, query heads,
    key/value heads (fewer with grouped-query attention) and the head size."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int


class Family(Architecture):
    """A transformer family: its module, config, plans, requests and warm-up (what the engine uses of it:
    mdtriton.engine.architecture), its presets and signature, and its pipeline if it serves one. Subclass it and
    register an instance (mdtriton.families: built in, or a user's package through the `mdtriton.families` entry point
    group)."""

    description: ClassVar[str]  # one line for `mdtriton build --help`
    pipeline: ClassVar[PipelinePart | None] = None  # the served diffusers pipeline, if the family has one
    # Further diffusers pipelines served with the family's transformer engine, by architecture name (FLUX: Kontext's,
    # "flux-kontext-pipeline"); each is built and served as the family's own pipeline is.
    more_pipelines: ClassVar[dict[str, PipelinePart]] = {}
    max_tokens: ClassVar[int] = DEFAULT_MAX_TOKENS  # the default limit of a request's tokens (mdtriton build --max-tokens)
    # Name prefixes of weights a diffusers checkpoint of the family may hold that the module does not (never read: a
    # head the served model does not use).
    unused_weights: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def presets(self) -> dict[str, dict]:
        """Named configs, the first being the default (tests' size)."""

    def default_config(self) -> dict:
        return next(iter(self.presets().values()))

    def config_from_diffusers(self, config_json: dict) -> dict:
        """The config of a diffusers checkpoint's `config.json`: its keys that this family's configs have, over the
        default config's."""
        known = self.default_config()
        return {**known, **{key: value for key, value in config_json.items() if key in known}}

    @abstractmethod
    def signature(self, config: dict, data_type: str) -> Signature:
        """The transformer engine's inputs and outputs (data_type: the engine's, e.g. BF16)."""

    def warm_up_sample(self, config: dict, plan: ParallelPlan) -> dict[str, list[int]]:
        """The input shapes of the small all-zeros request Triton sends each instance of a transformer engine at load
        (every rank runs it: the model is ready once the ranks have met); request_size must take it. By default each
        variable dimension of the signature is cp_size, so that every context-parallel rank gets real tokens."""
        inputs, _ = self.signature(config, "FP32")
        return {spec.name: [plan.cp_size if d == -1 else d for d in spec.shape] for spec in inputs}

    def attention_shape(self, config: dict) -> AttentionShape:
        """The model's attention, for `mdtriton bench`'s attention rows; by default from the config keys diffusers' FLUX
        and Wan transformers share (num_layers and num_single_layers, num_attention_heads, attention_head_dim)."""
        heads = config["num_attention_heads"]
        return AttentionShape(config["num_layers"] + config.get("num_single_layers", 0), heads, heads,
                              config["attention_head_dim"])

    def media_request(self, config: dict, frames: int, height: int, width: int,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A seeded request of batch 1 as the family's pipeline sends its transformer for `frames` frames (1: an
        image) of height x width pixels, with the pipeline's text length: what `mdtriton bench` measures. ValueError,
        saying what to send instead, for sizes the pipeline refuses. A family without it is not benchmarked."""
        raise NotImplementedError(f"family {self.name!r} makes no request from a size in pixels")
