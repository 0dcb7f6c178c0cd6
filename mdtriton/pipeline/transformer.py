"""The base of a family's adapter that a diffusers pipeline calls as its transformer: a transformer engine with
the attributes pipelines read of their transformer (dtype, device, cache_context)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from mdtriton.engine.dtypes import TORCH_DTYPES

if TYPE_CHECKING:
    from mdtriton.engine.engine import TorchEngine


class EngineAsTransformer(torch.nn.Module):
    """A transformer engine in a diffusers pipeline's `transformer` slot; subclasses give `config` (what the pipeline
    reads of its transformer's config) and `forward` (the diffusers model's call)."""

    def __init__(self, engine: TorchEngine):
        super().__init__()
        self.engine = engine
        self._dtype = TORCH_DTYPES[engine.manifest.data_type]

    @property
    def device(self) -> torch.device:
        return self.engine.comm.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def cache_context(self, name: str, **step):
        """Pipelines name each transformer call's cache context; the engine keeps no cache."""
        return nullcontext()
