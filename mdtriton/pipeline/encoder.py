"""A pipeline's prompt encoding on one rank: the encoding rank (rank 0) alone holds the text encoder, runs the
pipeline's `encode_prompt` and broadcasts what it returns (its tensors' data types and shapes, then the tensors) over
the Communicator; the other ranks load the pipeline without the text encoder and receive them. For a text encoder
that runs once per request and is large beside one broadcast of its output: FLUX.2 [dev]'s Mistral Small 3.1 (24 B,
44.7 GiB in bf16) encodes a prompt in about 46 ms into 15 MiB of embeddings; freeing it after each encoding would move
its weights back to the GPU for every request instead. A part declares the components this applies to
(PipelinePart.one_rank_components).

Every rank calls encode_prompt at the same point of the pipeline's call, so the broadcasts line up. The encoding may
fail (a prompt the tokenizer refuses): the ranks agree before the broadcast that no rank failed so far
(JobAgreement.early_collective), so a failure there ends the job on every rank instead of leaving the others waiting
in the broadcast. An elastic model's jobs run on groups of ranks that may not hold the encoding rank: every rank of it
keeps the text encoder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.job_control import JobAgreement, wait_for_device

ENCODING_RANK = 0
# The data types an encoding's tensors may have, by the index the broadcast header gives them.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
NO_TENSOR = -1  # the header's data type of an output that is None


def encode_on_one_rank(pipeline: Any, comm: Communicator, running_agreement: Callable[[], JobAgreement]) -> None:
    """Wrap the pipeline's encode_prompt on this rank: the encoding rank runs it, and every rank answers what it
    returned, broadcast after the running job's agreement (running_agreement: the job's, asked at each call)."""
    encode = pipeline.encode_prompt

    def encode_prompt(*args, **kwargs) -> tuple[torch.Tensor | None, ...]:
        outputs = None
        if comm.rank == ENCODING_RANK:
            outputs = encode(*args, **kwargs)
            check_outputs(outputs, type(pipeline).__name__)
        agreement = running_agreement()
        with agreement.early_collective():
            return broadcast_outputs(comm, outputs, agreement.control.timeout)

    pipeline.encode_prompt = encode_prompt


def check_outputs(outputs: Any, pipeline_name: str) -> None:
    """Raise TypeError unless outputs is what the broadcast sends: a tuple of tensors (or None) of DTYPES."""
    if not isinstance(outputs, tuple) or not all(output is None or (isinstance(output, torch.Tensor)
                                                                     and output.dtype in DTYPES) for output in outputs):
        raise TypeError(f"{pipeline_name}.encode_prompt returned {type(outputs).__name__}, not a tuple of tensors of "
                        f"{', '.join(str(dtype) for dtype in DTYPES)}: its encoding cannot be broadcast from one rank")


def broadcast_outputs(comm: Communicator, outputs: tuple[torch.Tensor | None, ...] | None,
                      timeout: float | None) -> tuple[torch.Tensor | None, ...]:
    """The encoding rank's outputs on every rank (on comm's device): the header's length, the header (each output's
    data type, dimensions and shape), then each tensor. outputs: the encoding rank's (None on the others); timeout: the
    longest a GPU rank waits to read the header (None: no limit)."""
    header = []
    if comm.rank == ENCODING_RANK:
        header.append(len(outputs))
        for output in outputs:
            header += [NO_TENSOR] if output is None else [DTYPES.index(output.dtype), output.dim(), *output.shape]
    length = read(comm.broadcast(torch.tensor([len(header)], device=comm.device), ENCODING_RANK), timeout)[0]
    if comm.rank != ENCODING_RANK:
        header = [0] * length
    header = read(comm.broadcast(torch.tensor(header, dtype=torch.int64, device=comm.device), ENCODING_RANK), timeout)
    received, place = [], 1
    for index in range(header[0]):
        dtype = header[place]
        if dtype == NO_TENSOR:
            received.append(None)
            place += 1
            continue
        dims = header[place + 1]
        shape = header[place + 2: place + 2 + dims]
        place += 2 + dims
        tensor = (outputs[index].to(comm.device).contiguous() if comm.rank == ENCODING_RANK
                  else torch.empty(shape, dtype=DTYPES[dtype], device=comm.device))
        received.append(comm.broadcast(tensor, ENCODING_RANK))
    return tuple(received)


def read(tensor: torch.Tensor, timeout: float | None) -> list[int]:
    """A small tensor's values on the host, waiting for them at most timeout seconds on a GPU."""
    if tensor.device.type == "cuda":
        wait_for_device(timeout)
    return tensor.tolist()
