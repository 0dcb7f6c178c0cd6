"""A job's control between the backend that runs it and the engine: its progress after each step, whether the rank
that received its request wants it stopped, and the points where every rank learns the same thing about it, so that
the ranks stop a job together or not at all.

The ranks run a job together: a rank that leaves it alone leaves the others waiting in a collective that never
completes, which only a new epoch of the ranks ends (backend/worker_keeper.py). So a pipeline's job stops early
only at points every rank reaches, where the ranks agree in one collective (`JobAgreement`):

- before its first collective (`before_collectives`): the pipeline's work until then (its adapters, the prompts'
  encoding, diffusers' checks) is every rank's own, so a rank that fails there meets the others at this agreement
  instead of in a collective (`failed`): every rank then raises JobFailed with that rank's error; a collective that
  every rank makes at a fixed point before the job's first transformer call (a prompt encoded on one rank and
  broadcast: mdtriton.pipeline.encoder) comes after such an agreement, and the ranks agree again before the next one
  (`early_collective`);
- after each step (`step_done`): whether the request's rank asked to stop (its client cancelled the request, or the
  request passed its deadline): every rank then raises JobStopped there. On GPUs the ranks read the answer one step
  later, so that reading it waits only for work the GPU has already done (no pause between steps): such a job stops
  one step later.

A job that fails anywhere else may leave a peer in a collective: its order is lost, and the backend heals.
The backend sets each job's control around the engine's call (`controlled_by`); outside it (tests, benchmarks)
progress goes nowhere and nothing asks to stop.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mdtriton.engine.comm import CommunicationError, Communicator

ProgressListener = Callable[[int, int], None]  # (steps done, steps in all)
# How often a rank looks whether its GPU has done the work it waits for (wait_for_event).
DEVICE_POLL_S = 0.0002
# The bytes of a failing rank's message that reach the other ranks.
MESSAGE_LIMIT = 2000


class JobStopped(Exception):
    """Every rank stopped the job after `done` of its `total` steps: the rank that received its request asked to."""

    def __init__(self, done: int, total: int):
        super().__init__(f"stopped after {done} of {total} steps")
        self.done = done
        self.total = total


class JobFailed(Exception):
    """Every rank stopped the job at the same point, before any collective of it, because a rank failed there: the
    ranks' order of collectives holds. request_error: the request was at fault (answered INVALID_ARG, not INTERNAL)."""

    def __init__(self, message: str, request_error: bool = False):
        super().__init__(message)
        self.request_error = request_error


@dataclass(frozen=True)
class JobControl:
    """What the backend gives a job: a listener for its steps, whether to stop it (read at every step; only the rank
    that received the request says yes), and how long a rank waits for its peers' agreement (None: no limit)."""

    on_progress: ProgressListener | None = None
    stop_requested: Callable[[], bool] = lambda: False
    timeout: float | None = None


_control: contextvars.ContextVar[JobControl] = contextvars.ContextVar("mdtriton_job_control", default=JobControl())


@contextmanager
def controlled_by(control: JobControl) -> Iterator[None]:
    """Run the engine calls inside this block as the job that `control` describes."""
    token = _control.set(control)
    try:
        yield
    finally:
        _control.reset(token)


def current_control() -> JobControl:
    return _control.get()


def wait_for_event(event: torch.cuda.Event, timeout: float | None) -> None:
    """Wait for a CUDA event at most timeout seconds (None: without a limit).

    NCCL's collectives are queued with no wait on the CPU (mdtriton.engine.comm), so a collective with a stopped or
    stuck peer shows only when a rank waits for its work: CommunicationError after the timeout, not a wait forever."""
    if timeout is None:
        event.synchronize()
        return
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            raise CommunicationError(f"GPU work, collectives included, did not complete within {timeout:.0f} s (a rank "
                                     "stopped or stuck)")
        time.sleep(DEVICE_POLL_S)


def wait_for_device(timeout: float | None) -> None:
    """Wait for the work queued so far on the current CUDA stream, at most timeout seconds (wait_for_event)."""
    done = torch.cuda.Event()
    done.record()
    wait_for_event(done, timeout)


class JobAgreement:
    """One pipeline job's agreement points on one rank (see the module's doc); every rank makes one per job."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.control = current_control()
        self.agreed = False  # this rank has passed the point before the job's first collective
        # GPUs: the last step's verdict, unread, its event and the step it is of
        self._pending: tuple[torch.Tensor, torch.cuda.Event, int] | None = None

    def before_collectives(self) -> None:
        """Called before each of the job's collective parts (a transformer call): the first time, the ranks agree that
        none has failed so far, or every rank raises JobFailed."""
        if not self.agreed:
            self._agree(0)

    @contextmanager
    def early_collective(self) -> Iterator[None]:
        """Around a collective that every rank makes at the same point before the job's collective parts: the ranks
        agree first that none has failed so far (or every rank raises JobFailed), and once it is over agree again
        before the next collective, so that a failure between the two still ends the job on every rank. Past the job's
        first collective part, it agrees on nothing."""
        if self.agreed:
            yield
            return
        self._agree(0)
        yield
        self.agreed = False

    def failed(self, message: str, request_error: bool) -> None:
        """This rank's part of the job raised (message: what, for the request's answer). Before the job's first
        collective the ranks agree on it: every rank raises JobFailed. Returns if this rank has passed that point: its
        peers may be in a collective, and the caller must let the error end the ranks' epoch."""
        if not self.agreed:
            world = self.comm.plan.world_size
            self._agree((2 if request_error else 1) * world + (world - 1 - self.comm.rank), message)

    def _agree(self, code: int, message: str = "") -> None:
        """Every rank gives its code (0: no failure; else its kind and rank, as failed() makes it) and learns the
        largest: the first rank of the worst kind of failure, whose message it then broadcasts."""
        self.agreed = True
        comm, world = self.comm, self.comm.plan.world_size
        verdict = self._read(comm.world_max(torch.full((1,), code, dtype=torch.int64, device=comm.device)))[0]
        if verdict == 0:
            return
        rank = world - 1 - verdict % world
        text = (message or "no message").encode()[:MESSAGE_LIMIT] if rank == comm.rank else b""
        length = self._read(comm.broadcast(torch.full((1,), len(text), dtype=torch.int64, device=comm.device), rank))[0]
        data = torch.zeros(length, dtype=torch.uint8)
        if text:
            data.copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
        received = bytes(self._read(comm.broadcast(data.to(comm.device), rank))).decode(errors="replace")
        raise JobFailed(received if world == 1 else f"rank {rank}: {received}", request_error=verdict >= 2 * world)

    def step_done(self, done: int, total: int, latents: torch.Tensor | None = None) -> None:
        """A step of the job is done: report it, and stop here (JobStopped, every rank) if the request's rank asked, or
        fail the job (JobFailed, every rank) if the step's latents hold a NaN or an infinity, which would be answered
        as a flat or noise image. Both are read from one small tensor: on GPUs one step later, so that reading it
        waits only for work the GPU has already done (`finish` reads the last step's)."""
        control = self.control
        if control.on_progress is not None:
            control.on_progress(done, total)
        comm = self.comm
        stop = control.stop_requested()
        if stop and comm.plan.world_size == 1:
            raise JobStopped(done, total)  # no other rank to tell
        # 1: stop asked; 2: latents not finite (their sum is finite when every value is, without a tensor their size).
        flags = torch.full((1,), int(stop), dtype=torch.int32, device=comm.device)
        if latents is not None:
            flags += 2 * (~torch.isfinite(latents.sum())).to(device=comm.device, dtype=torch.int32)
        if comm.plan.world_size > 1:
            flags = comm.world_max(flags)
        if comm.device.type != "cuda":
            self._judge(int(flags[0]), done, total)  # gloo's collective has completed
            return
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        previous, self._pending = self._pending, (host, ready, done)
        if previous is not None:
            wait_for_event(previous[1], self.control.timeout)
            self._judge(int(previous[0][0]), previous[2], total)

    def finish(self, total: int) -> None:
        """The job's steps are over: on GPUs, read the last step's verdict (step_done), which may fail the job."""
        previous, self._pending = self._pending, None
        if previous is not None:
            wait_for_event(previous[1], self.control.timeout)
            self._judge(int(previous[0][0]) & 2, previous[2], total)  # too late to stop: only a failure counts

    @staticmethod
    def _judge(verdict: int, done: int, total: int) -> None:
        """Raise what the ranks' verdict after step `done` says (step_done's flags), if anything."""
        if verdict >= 2:
            raise JobFailed(f"the latents held NaN or infinite values after denoising step {done} of {total} (the "
                            "model's weights, an adapter or the request's values overflowed); the request was stopped "
                            "there")
        if verdict:
            raise JobStopped(done, total)

    def _read(self, tensor: torch.Tensor) -> list[int]:
        """A small tensor's values on the host, waiting for it at most the control's timeout on a GPU."""
        if tensor.device.type == "cuda":
            wait_for_device(self.control.timeout)
        return tensor.tolist()
