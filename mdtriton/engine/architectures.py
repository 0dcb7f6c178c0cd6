"""The architectures an engine can be, by the name stored in its manifest.

An architecture is an nn.Module class built as `cls(config, comm)` for one rank, whose forward takes
the inputs by name and returns a dict of full (unsplit) outputs on every rank, with static methods
`default_config()`, `presets()` (named configs), `check_plan(config, plan)` (raise ValueError saying
what to change), `signature(config, data_type)` -> (input TensorSpecs, output TensorSpecs), and
`check_request(config, inputs)` -> (batch size, tokens): raise ValueError, saying what to send instead,
if the inputs (already of the signature's types and ranks) do not fit together.
"""

from __future__ import annotations

import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.models.flux import Flux
from mdtriton.engine.models.tiny_transformer import TinyTransformer
from mdtriton.engine.plan import ParallelPlan

ARCHITECTURES = {
    "tiny_transformer": TinyTransformer,
    "flux": Flux,
}


def architecture(name: str):
    """The architecture class registered under name."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise EngineError(f"unknown architecture {name!r}; known: {', '.join(sorted(ARCHITECTURES))}") from None


def meta_module(name: str, config: dict, plan: ParallelPlan, rank: int) -> torch.nn.Module:
    """Rank's module of architecture name, without memory: for weight names, shapes and splits."""
    with torch.device("meta"):
        return architecture(name)(config, Communicator(plan, rank, torch.device("meta")))
