"""The architectures an engine can be, by the name stored in its manifest.

An architecture is an nn.Module class built as `cls(config, comm)` for one rank (`cls(config, comm, fp8=True)`
where its class attribute `supports_fp8` is true), whose forward takes the inputs by name and returns a dict
of full (unsplit) outputs on every rank, with methods `fuse_projections()` (called once the weights are
loaded) and `compiled_regions()` (the modules worth compiling on GPUs), and static methods
`example_inputs(config, text_tokens, image_tokens, dtype)` (a request, for warm-ups and benchmarks),
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


def check_quantization(name: str, quantization: str | None) -> None:
    """Raise EngineError, saying what to build instead, if architecture name cannot hold quantized weights."""
    if quantization is not None and not getattr(architecture(name), "supports_fp8", False):
        raise EngineError(f"architecture {name!r} has no {quantization} weights; build it with --dtype BF16")


def new_module(name: str, config: dict, comm: Communicator, quantization: str | None = None) -> torch.nn.Module:
    """Rank's module of architecture name, its weights not yet loaded (made on the current default device)."""
    check_quantization(name, quantization)
    cls = architecture(name)
    return cls(config, comm) if quantization is None else cls(config, comm, fp8=True)


def meta_module(name: str, config: dict, plan: ParallelPlan, rank: int,
                quantization: str | None = None) -> torch.nn.Module:
    """Rank's module of architecture name, without memory: for weight names, shapes and splits."""
    with torch.device("meta"):
        return new_module(name, config, Communicator(plan, rank, torch.device("meta")), quantization)


def loaded_module(name: str, config: dict, comm: Communicator, weights: dict[str, torch.Tensor],
                  quantization: str | None = None) -> torch.nn.Module:
    """Rank's module with its weights (taken as they are: dtype and device), projections fused, in eval mode.

    Raises EngineError if the weights do not fit the architecture."""
    with torch.device("meta"):
        module = new_module(name, config, comm, quantization)
    try:
        module.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as error:
        raise EngineError(f"weights do not fit architecture {name!r}: {error}") from error
    module.fuse_projections()
    return module.eval()
