"""What an engine needs of its model family, handed to it by whoever loads it.

The engine knows no family by name: the build, the server and the benchmarks look a family up (mdtriton.families)
and give the engine the object, whose class implements `Architecture` (every `Family` does). With it the engine
makes a rank's module, checks a plan and a request's size, and warms a compiled module up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn

from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan


@dataclass(frozen=True)
class RequestSize:
    """How big a request is, as the engine's limits count it: samples, and tokens in the sequence its attention
    runs over (the family says what a token is: FLUX's text plus image tokens, a video's patches)."""

    batch: int
    tokens: int


class TransformerModule(Protocol):
    """One rank's module of a family (an nn.Module), built as `module_class(config, comm)` (with `fp8=True` too
    where the family supports FP8): forward takes the inputs by name and returns the full (unsplit) outputs by
    name on every rank."""

    def fuse_projections(self) -> None:
        """Arrange the loaded weights for speed (e.g. q, k and v in one GEMM); called once, after the load."""

    def compiled_regions(self) -> list[nn.Module]:
        """The modules worth compiling on GPUs (blocks between collectives)."""


class Architecture(ABC):
    """A transformer's module, plans, request sizes and warm-up: the part of a family (mdtriton.families.family) that
    the engine uses."""

    name: ClassVar[str]  # the architecture name of its transformer engines (a manifest's `architecture`)
    module_class: ClassVar[type[nn.Module]]  # implements TransformerModule
    supports_fp8: ClassVar[bool] = False  # module_class takes fp8=True: its linear weights in e4m3

    @abstractmethod
    def check_plan(self, config: dict, plan: ParallelPlan) -> None:
        """Raise ValueError, saying what to change, if config is not one of this family's or plan cannot split it."""

    @abstractmethod
    def request_size(self, config: dict, inputs: dict[str, torch.Tensor]) -> RequestSize:
        """The size of a request to the transformer engine, as its limits count it; ValueError, saying what to send
        instead, if its inputs (already of the signature's types and ranks, no value read) do not fit together. It
        must take warm_up_sample's request."""

    @abstractmethod
    def warm_up_requests(self, config: dict, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        """The requests a GPU load runs, in order, to compile every graph later requests need (mdtriton.engine.compile)."""

    @abstractmethod
    def example_request(self, config: dict, tokens: int, dtype: torch.dtype,
                        batch: int = 1) -> dict[str, torch.Tensor]:
        """A seeded request of `tokens` tokens (as request_size counts them), laid out as a typical one: for
        benchmarks and tests, and for an elastic plan's table of group times (mdtriton.engine.group_times)."""

    def new_module(self, config: dict, comm: Communicator, quantization: str | None = None) -> nn.Module:
        """Rank's module, its weights not yet loaded (made on the current default device)."""
        if quantization is None:
            return self.module_class(config, comm)
        if not self.supports_fp8:
            raise EngineError(f"architecture {self.name!r} has no {quantization} weights; build it with --dtype BF16")
        return self.module_class(config, comm, fp8=True)
