"""A family's module for one rank, by architecture name: empty (meta, for weight names, shapes and splits) or with
its weights loaded."""

from __future__ import annotations

import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import family


def new_module(architecture: str, config: dict, comm: Communicator, quantization: str | None = None) -> torch.nn.Module:
    """Rank's module of the architecture's family, its weights not yet loaded (made on the current default device)."""
    return family(architecture).new_module(config, comm, quantization)


def meta_module(architecture: str, config: dict, plan: ParallelPlan, rank: int,
                quantization: str | None = None) -> torch.nn.Module:
    """Rank's module of the architecture's family, without memory: for weight names, shapes and splits."""
    with torch.device("meta"):
        return new_module(architecture, config, Communicator(plan, rank, torch.device("meta")), quantization)


def loaded_module(architecture: str, config: dict, comm: Communicator, weights: dict[str, torch.Tensor],
                  quantization: str | None = None) -> torch.nn.Module:
    """Rank's module with its weights (taken as they are: dtype and device), projections fused, in eval mode.

    Raises EngineError if the weights do not fit the architecture."""
    with torch.device("meta"):
        module = new_module(architecture, config, comm, quantization)
    try:
        module.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as error:
        raise EngineError(f"weights do not fit architecture {architecture!r}: {error}") from error
    module.fuse_projections()
    return module.eval()


def stored_dtype(module: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype weight `name` of module is stored in for an engine of dtype: float32 for the modules the family
    keeps in float32 (its module's `keep_in_float32`, names matched as diffusers' _keep_in_fp32_modules are: any
    dotted part of the weight's name), else dtype."""
    kept = getattr(module, "keep_in_float32", ())
    return torch.float32 if any(part in kept for part in name.split(".")) else dtype
