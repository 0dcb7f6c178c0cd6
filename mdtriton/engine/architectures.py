"""The architectures an engine can be, by the name stored in its manifest.

An architecture is an nn.Module class built as `cls(config, comm)` for one rank, whose forward takes
the inputs by name and returns a dict of full (unsplit) outputs on every rank, with static methods
`default_config()`, `check_plan(config, plan)` (raise ValueError saying what to change),
`signature(config, data_type)` -> (input TensorSpecs, output TensorSpecs), and
`check_request(config, inputs)` -> (batch size, tokens): raise ValueError, saying what to send instead,
if the inputs (already of the signature's types and ranks) do not fit together.
"""

from __future__ import annotations

from mdtriton.engine.manifest import EngineError
from mdtriton.engine.models.flux import Flux
from mdtriton.engine.models.tiny_transformer import TinyTransformer

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
