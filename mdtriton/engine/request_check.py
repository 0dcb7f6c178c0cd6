"""Check one request against the engine before any rank sees it.

Triton already refuses a wrong data type, a wrong number of dimensions, a wrong fixed dimension and a
missing input (they are in config.pbtxt). What only the engine knows is checked here, in two parts:

- `check_engine_request`, in the Triton stub that received the request: no empty tensor, inputs that fit together
  (the family's own check, e.g. FLUX's position ids), and the limits recorded in the manifest. It reads
  shapes only.
- `check_finite`, no NaN or infinity, in the rank's worker on the copy of the inputs it makes on its device
  anyway (backend/job_runner.py), before the job is ordered: on a GPU, reading every value (5 MB for FLUX.1-dev)
  takes a few kernels and one wait, where it took 0.75 ms of the stub's CPU on the request's path.

A request that fails either is answered with INVALID_ARG by the rank that received it, so it never reaches the
other ranks or the collective order.
"""

from __future__ import annotations

import torch

from mdtriton.engine.architecture import Architecture
from mdtriton.engine.manifest import Manifest


class RequestError(ValueError):
    """A request this engine cannot take; the message says what is wrong and what to send instead."""


def check_engine_request(manifest: Manifest, architecture: Architecture, inputs: dict[str, torch.Tensor]) -> None:
    """Raise RequestError if the inputs (by name) are not a request this engine (of architecture) can run; values are
    not read (check_finite does that)."""
    for spec in manifest.inputs:
        tensor = inputs.get(spec.name)
        if tensor is None:
            raise RequestError(f"input {spec.name!r} is missing; this model takes "
                               f"{', '.join(s.name for s in manifest.inputs)}")
        if tensor.numel() == 0:
            raise RequestError(f"input {spec.name!r} is empty (shape {list(tensor.shape)}); "
                               "every dimension must be at least 1")
    try:
        size = architecture.request_size(manifest.config, inputs)
    except ValueError as error:
        raise RequestError(str(error)) from None
    limits = manifest.limits
    batch, tokens = size.batch, size.tokens
    if batch > limits.max_batch_size:
        raise RequestError(f"batch size {batch} is over this engine's maximum of {limits.max_batch_size}; send at most "
                           f"{limits.max_batch_size} samples per request (the limit is set at build time: "
                           "mdtriton build --max-batch-size)")
    if tokens > limits.max_tokens:
        raise RequestError(f"the sequence has {tokens} tokens, over this engine's maximum of {limits.max_tokens}; "
                           "send a shorter one (the limit is set at build time: mdtriton build --max-tokens)")


def check_finite(inputs: dict[str, torch.Tensor]) -> None:
    """Raise RequestError naming the first floating-point input that holds a NaN or an infinity.

    The inputs may be on any device; the check waits for that device once (more only for a request it refuses)."""
    floats = {name: tensor for name, tensor in inputs.items() if tensor.is_floating_point()}
    if not floats:
        return
    # A sum is finite when every value is, and needs no tensor the size of the input; only a NaN, an infinity or an
    # overflowing sum makes it count the values. The sums are read all at once: one wait. (Summed in the inputs'
    # own type: sum(dtype=torch.float32) of bf16 took 8 times as long on CPU.)
    sums = torch.stack([tensor.sum().float() for tensor in floats.values()])
    for (name, tensor), finite in zip(floats.items(), torch.isfinite(sums).tolist()):
        if not finite:
            bad = tensor.numel() - int(torch.isfinite(tensor).sum())
            if bad:
                raise RequestError(f"input {name!r} holds {bad} NaN or infinite value(s); send finite numbers")
