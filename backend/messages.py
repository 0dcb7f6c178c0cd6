"""The messages of the backend's two links, as frozen records; JSON only at the edge.

- Between a rank's stub (WorkerKeeper) and its worker process (RankWorker), over a TensorLink (a message's tensors
  travel beside its header, in shared memory): `send` and `receive`.
- Between a worker's job runner and rank 0's job hub (or, in a world of one rank, SingleRankLink), over a
  multiprocessing Connection: `send_over` and `receive_over` (an elastic model's inputs and answers travel there too,
  as host memory: each tensor's bytes in a frame of their own after the header).

A header of a kind not listed here is a ProtocolError, never taken for another kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from typing import ClassVar

import torch

from mdtriton.backend.tensor_transfer import TensorLink
from mdtriton.engine.dtypes import TORCH_DTYPES, TRITON_TYPES


class ProtocolError(RuntimeError):
    """A message this end does not know: the stub and its worker run different code."""


class RanksUnavailable(Exception):
    """The ranks are not (or no longer) together, so no job can run now (raised by a worker's job runner and by its
    stub's keeper alike)."""


# --- from the stub to its worker ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunRequest:
    """Run a request; `deadline`: the request's one deadline, set by the stub as it received the request, by which the
    ranks must have answered it (a job that has not started by then is dropped).

    The deadline is a time.monotonic() of the stub's process, read by the worker, another process: on Linux
    time.monotonic() is CLOCK_MONOTONIC, one clock for the whole system, and a stub and its worker share a machine."""

    kind: ClassVar[str] = "job"
    id: str
    deadline: float
    tensors: dict[str, torch.Tensor] = field(repr=False)


@dataclass(frozen=True)
class Cancel:
    """Drop a job, or stop it at its next step: its request no longer waits for it (why: cancelled by its client, or
    past its deadline)."""

    kind: ClassVar[str] = "cancel"
    id: str
    reason: str


@dataclass(frozen=True)
class Stop:
    """Leave the epoch and exit (the model is unloading, or the stub is gone)."""

    kind: ClassVar[str] = "stop"


# --- from the worker to its stub ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Loaded:
    """The engine is loaded (the ranks may not have met yet)."""

    kind: ClassVar[str] = "loaded"


@dataclass(frozen=True)
class Serving:
    """An epoch of the ranks has formed and takes jobs: its number and members (rank -> worker pid)."""

    kind: ClassVar[str] = "serving"
    epoch: int
    members: dict[int, int]


@dataclass(frozen=True)
class Started:
    """The ranks have begun a job."""

    kind: ClassVar[str] = "started"
    id: str


@dataclass(frozen=True)
class Progress:
    """A job's step is done (reported for every job the rank runs: the stub judges by them whether its worker is
    stuck)."""

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
    """A request that is wrong (inputs that are not finite, an adapter that cannot be used), and why: it was never
    run, or every rank ended its job at the same point (the ranks serve on)."""

    kind: ClassVar[str] = "refused"
    id: str
    reason: str


@dataclass(frozen=True)
class Failed:
    """A job that failed on a rank before any collective of it, and why: every rank ended it at the same point, so
    the ranks serve on and the request is answered with the failure."""

    kind: ClassVar[str] = "failed"
    id: str
    reason: str


@dataclass(frozen=True)
class Stopped:
    """A job its stub cancelled, ended on every rank: after `done` of its `total` steps (0 of 0: before it started)."""

    kind: ClassVar[str] = "stopped"
    id: str
    done: int
    total: int


@dataclass(frozen=True)
class JobTimed:
    """A job's seconds in collectives, in compute, and waiting for the ranks; group: the ranks an elastic model's job
    ran on, e.g. "0-1" ("" for every other model's)."""

    kind: ClassVar[str] = "job_timed"
    communication: float
    compute: float
    waited: float
    group: str = ""


@dataclass(frozen=True)
class QueueLength:
    """How many jobs of an elastic model wait for a group of ranks now (rank 0's worker, where the job hub is)."""

    kind: ClassVar[str] = "queue_length"
    waiting: int


@dataclass(frozen=True)
class Ended:
    """The worker's epoch ended (it exits next): why, and whether because the model is unloading. The stub
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


# --- from a job runner to the job hub ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    """The first message on a runner's connection: which rank it is."""

    kind: ClassVar[str] = "hello"
    rank: int


@dataclass(frozen=True)
class Submit:
    """A job this rank received, to be put in the order: its id, this rank, its inputs' [name, data type, shape]. An
    elastic model's job also brings its deadline (time.monotonic(), one clock for the machine), its checked inputs
    (in host memory), which the hub hands to the group that runs it, and its tokens (Engine.request_tokens; None if
    the engine cannot tell), by which the hub sizes its group."""

    kind: ClassVar[str] = "submit"
    job: str
    origin: int
    inputs: list
    deadline: float | None = None
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    tokens: int | None = None


@dataclass(frozen=True)
class Finished:
    """An elastic model's rank has ended a job (or left it): the hub may start another job on it."""

    kind: ClassVar[str] = "job_finished"
    job: str
    rank: int


@dataclass(frozen=True)
class Result:
    """How an elastic model's job ended, from the leader of its group to its origin, through the hub: `outcome` done
    (the outputs in `tensors`), refused or failed (`reason`), or stopped (after `done` of `total` steps)."""

    kind: ClassVar[str] = "result"
    job: str
    outcome: str
    reason: str = ""
    done: int = 0
    total: int = 0
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Withdraw:
    """An elastic model's job whose request no longer waits for it (why: reason), from its origin to the hub, which
    drops it if it waits, or tells the leader of its group, which stops it after its next step."""

    kind: ClassVar[str] = "withdraw"
    job: str
    reason: str


@dataclass(frozen=True)
class Leave:
    """This rank leaves the epoch: why, and whether because the model is unloading."""

    kind: ClassVar[str] = "leave"
    reason: str
    unloading: bool


# --- from the job hub to every runner ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """Run this job now, every rank: a Submit, numbered in the order. An elastic model's job runs on `group` only
    (global ranks; its first, the leader, answers), with its deadline and inputs; its origin, if not in the group,
    is told too (without the inputs): its job has started."""

    kind: ClassVar[str] = "run"
    job: str
    origin: int
    inputs: list
    sequence: int
    group: list | None = None
    deadline: float | None = None
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class EndEpoch:
    """The epoch is over for every rank: why, and whether because the model is unloading."""

    kind: ClassVar[str] = "end_epoch"
    reason: str
    unloading: bool


Message = (RunRequest | Cancel | Stop | Loaded | Serving | Started | Progress | Done | Refused | Failed | Stopped | JobTimed
           | QueueLength | Ended | GivenUp | Hello | Submit | Finished | Result | Withdraw | Leave | Run | EndEpoch)
KINDS: dict[str, type] = {cls.kind: cls for cls in (RunRequest, Cancel, Stop, Loaded, Serving, Started, Progress, Done,
                                                     Refused, Failed, Stopped, JobTimed, QueueLength, Ended, GivenUp,
                                                     Hello, Submit,
                                                     Finished, Result, Withdraw, Leave, Run, EndEpoch)}


def header_of(message: Message) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """The JSON header of message, and its tensors (if any), which travel beside it."""
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
    return header, tensors


def message_of(header: dict) -> Message:
    """The message of a header (with its tensors under "tensors"); ProtocolError for a kind not listed here."""
    kind = header.pop("type", None)
    if kind not in KINDS:
        raise ProtocolError(f"a message of unknown kind {kind!r} (the two ends run different code?)")
    if kind == Serving.kind:
        header["members"] = {int(rank): pid for rank, pid in header["members"].items()}
    return KINDS[kind](**header)


def send(link: TensorLink, message: Message) -> None:
    """Send message over a stub-worker link: its fields as the header, its tensors (if any) beside it."""
    link.send(*header_of(message))


def receive(link: TensorLink) -> Message:
    """The next message on a stub-worker link."""
    return message_of(link.receive())


def send_over(connection: Connection, message: Message) -> None:
    """Send message over a runner-hub connection: its header, then the bytes of each of its tensors (host memory), if
    it has any."""
    header, tensors = header_of(message)
    if tensors is not None:
        header["tensors"] = [[name, TRITON_TYPES[tensor.dtype], list(tensor.shape)] for name, tensor in tensors.items()]
    connection.send_bytes(json.dumps(header).encode())
    for tensor in (tensors or {}).values():
        connection.send_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def receive_over(connection: Connection) -> Message:
    """The next message on a runner-hub connection (its tensors in host memory)."""
    header = json.loads(connection.recv_bytes())
    if header.get("tensors") is not None:
        tensors = {}
        for name, data_type, shape in header["tensors"]:
            data = connection.recv_bytes()
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            tensors[name] = raw.view(TORCH_DTYPES[data_type]).reshape(shape)
        header["tensors"] = tensors
    return message_of(header)
