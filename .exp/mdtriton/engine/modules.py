"""A family's module for one rank (the family handed in as its Architecture): empty (meta, for weight names, shapes
and splits) or with its weights loaded."""

from __future__ import annotations

import torch

from mdtriton.engine.architecture import Architecture
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan


def meta_module(architecture: Architecture, config: dict, plan: ParallelPlan, rank: int,
                quantization: str | None = None) -> torch.nn.Module:
    """Rank's module of the architecture, without memory: for weight names, shapes and splits."""
    with torch.device("meta"):
        return architecture.new_module(config, Communicator(plan, rank, torch.device("meta")), quantization)


def loaded_module(architecture: Architecture, config: dict, comm: Communicator, weights: dict[str, torch.Tensor],
                  quantization: str | None = None) -> torch.nn.Module:
    """Rank's module with its weights (taken as they are: dtype and device), projections fused, in eval mode.

    Raises EngineError if the weights do not fit the architecture."""
    with torch.device("meta"):
        module = architecture.new_module(config, comm, quantization)
    try:
        module.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as error:
        raise EngineError(f"weights do not fit architecture {architecture.name!r}: {error}") from error
    module.fuse_projections()
    return module.eval()


def stored_dtype(module: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype weight `name` of module is stored in for an engine of dtype: float32 for the modules the family
    keeps in float32 (its module's `keep_in_float32`, names matched as diffusers' _keep_in_fp32_modules are: any
    dotted part of the weight's name), else dtype."""
    kept = getattr(module, "keep_in_float32", ())
    return torch.float32 if any(part in kept for part in name.split(".")) else dtype
