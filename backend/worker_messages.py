"""The messages between a rank's stub (WorkerKeeper) and its worker process (RankWorker): frozen records, JSON only at
the edge (TensorLink's header; a message's tensors travel beside it, in shared memory).

`send(link, message)` and `receive(link)` turn them into and out of headers; a header of a kind not listed here is a
ProtocolError, never taken for another kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from mdtriton.backend.tensor_transfer import TensorLink


class ProtocolError(RuntimeError):
    """A message this end does not know: the stub and its worker run different code."""


# --- from the stub to its worker ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """Run a request; `progress`: report each step of it."""

    kind: ClassVar[str] = "job"
    id: str
    progress: bool
    tensors: dict[str, torch.Tensor] = field(repr=False)


@dataclass(frozen=True)
class Stop:
    """Leave the generation and exit (the model is unloading, or the stub is gone)."""

    kind: ClassVar[str] = "stop"


# --- from the worker to its stub ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Loaded:
    """The engine is loaded (the ranks may not have met yet)."""

    kind: ClassVar[str] = "loaded"


@dataclass(frozen=True)
class Serving:
    """A generation of the ranks has formed and takes jobs: its number and members (rank -> worker pid)."""

    kind: ClassVar[str] = "serving"
    generation: int
    members: dict[int, int]


@dataclass(frozen=True)
class Started:
    """The ranks have begun a job."""

    kind: ClassVar[str] = "started"
    id: str


@dataclass(frozen=True)
class Progress:
    """A job's step is done."""

    kind: ClassVar[str] = "progress"
    id: str
    done: int
    total: int


@dataclass(frozen=True)
class Done:
    """A job's outputs."""

    kind: ClassVar[str] = "done"
    id: str
    tensors: dict[str, torch.Tensor] = field(repr=False)


@dataclass(frozen=True)
class Refused:
    """A job that is never to run (inputs that are not finite), and why."""

    kind: ClassVar[str] = "refused"
    id: str
    reason: str


@dataclass(frozen=True)
class JobTimed:
    """A job's seconds in collectives, in compute, and waiting for the ranks."""

    kind: ClassVar[str] = "job_timed"
    communication: float
    compute: float
    waited: float


@dataclass(frozen=True)
class Ended:
    """The worker's generation ended (it exits next): why, and whether because the model is unloading. The stub
    starts another worker unless it is."""

    kind: ClassVar[str] = "ended"
    reason: str
    unloading: bool = False


@dataclass(frozen=True)
class GivenUp:
    """The worker cannot serve and should not be restarted (it exits next): why."""

    kind: ClassVar[str] = "given_up"
    reason: str
    unloading: bool = False


Message = Job | Stop | Loaded | Serving | Started | Progress | Done | Refused | JobTimed | Ended | GivenUp
KINDS: dict[str, type] = {cls.kind: cls for cls in (Job, Stop, Loaded, Serving, Started, Progress, Done, Refused,
                                                     JobTimed, Ended, GivenUp)}


def send(link: TensorLink, message: Message) -> None:
    """Send message over link: its fields as the header, its tensors (if any) beside it."""
    header = {"type": message.kind}
    tensors = None
    for item in fields(message):
        value = getattr(message, item.name)
        if item.name == "tensors":
            tensors = value
        elif isinstance(message, Serving) and item.name == "members":
            header["members"] = {str(rank): pid for rank, pid in value.items()}  # JSON keys are text
        else:
            header[item.name] = value
    link.send(header, tensors)


def receive(link: TensorLink) -> Message:
    """The next message on link; ProtocolError for a kind this module does not list."""
    header = link.receive()
    kind = header.pop("type", None)
    if kind not in KINDS:
        raise ProtocolError(f"a message of unknown kind {kind!r} (the stub and the worker run different code?)")
    if kind == Serving.kind:
        header["members"] = {int(rank): pid for rank, pid in header["members"].items()}
    return KINDS[kind](**header)
