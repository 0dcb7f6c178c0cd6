"""Keeps this rank's worker process running, and every request of this instance answered across its restarts.

Lives in the Triton stub, which stays thin: the worker (backend/rank_worker.py) owns the device, the engine and
the communicator, so whatever kills a worker never kills the stub or the server. A worker serves one epoch
of the ranks. When it ends (its epoch failed, or the worker died, or it gave no answer in time), the
keeper *heals*: it gives the other workers of that epoch 2 s to end by themselves and kills those that did
not (a stopped or stuck one), then starts a new worker, which loads again and meets the other ranks' new workers.

Requests are never lost to a healing: a job is a pure function of its inputs, so requests in flight and those
that arrive meanwhile wait (up to their deadline) and run on the new workers. A request that was running at
two failures in a row is the likely cause: it fails, saying so, and is not run again (a poison request). A rank
whose worker keeps dying is given up after `heal_limit` deaths within `heal_window_s`: its requests, and through
the rendezvous every other rank's, then fail at once, naming the rank and what to do.

Only a lost or stuck worker heals. A request the ranks refuse or fail together is answered and the worker serves
on; a request whose caller stopped waiting (cancelled, or past its deadline) is dropped or stopped by the ranks
(give_up). A worker is stuck when it holds requests and reports nothing (no step, no job done) for
`request_timeout_s`: a long queue makes progress, so it is no sign of one.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from mdtriton.backend.process_state import ProcessState, process_state
from mdtriton.backend.rendezvous import Rendezvous
from mdtriton.backend.tensor_transfer import TensorLink
from mdtriton.backend.worker_spec import WorkerSpec
from mdtriton.backend.messages import (Cancel, Done, Ended, Failed, GivenUp, JobTimed, Loaded, Progress,
                                       ProtocolError, QueueLength, RanksUnavailable, Refused, RunRequest, Serving,
                                       Started, Stop, Stopped, receive, send)
from mdtriton.engine.job_control import JobFailed, JobStopped, ProgressListener
from mdtriton.engine.request_check import RequestError

log = logging.getLogger("mdtriton.backend")

# How long the other workers of a failed epoch get to end by themselves before they are killed.
PEER_EXIT_GRACE_S = 2.0
WATCH_INTERVAL_S = 0.2
# How long an unloading stub waits for its worker to exit before killing it. The worker gives its epoch's
# teardown less (job_runner.LEAVE_TIMEOUT_S), so that it leaves the rendezvous area and exits first.
STOP_TIMEOUT_S = 10.0
RELOAD_ADVICE = ("reload the model once the cause is fixed (unload and load it through the model control API, "
                 "server started with --model-control-mode=explicit), or restart the server; the server log has "
                 "each failure")


class PoisonRequest(Exception):
    """This request was running at two failures of the ranks in a row, so it is not run again."""


@dataclass
class Request:
    """One request of this instance, kept until it is answered, so that it can be run again after a healing."""

    inputs: dict[str, torch.Tensor]
    deadline: float  # time.monotonic() by which the ranks must answer it (set by the stub as it received it)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    answer: Future = field(default_factory=Future)
    held: bool = False  # handed to the current worker
    running: bool = False  # the ranks are running it (the worker said so)
    failures: int = 0  # failures of the ranks while it was running
    abandoned: bool = False  # its caller stopped waiting; kept until the worker is done with it
    on_progress: ProgressListener | None = None  # told of the steps the engine reports (pipelines)
    steps_reported: int = 0  # the most steps told to on_progress: a run again after a healing goes on from there


def python_executable() -> str:
    """The Python interpreter of this environment (inside a Triton stub, sys.executable is not always one)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return str(Path(sys.base_exec_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")


def is_rank_worker(pid: int) -> bool:
    try:
        return b"mdtriton.backend.rank_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def how_it_ended(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


class WorkerKeeper:
    def __init__(self, spec: WorkerSpec, world_size: int, heal_limit: int, heal_window_s: float, on_job_timed,
                 on_queue_length):
        """on_job_timed(communication_s, compute_s, waited_s, group): called for every job the worker ran
        (backend/metrics.py), on the keeper thread, when no answer of this instance is on its way back (see
        _record_job_times); on_queue_length(waiting): likewise, with the last count of an elastic model's jobs
        waiting for a group that rank 0's worker reported."""
        self.spec = spec
        self.rank = spec.rank
        self.world_size = world_size
        self.heal_limit = heal_limit
        self.heal_window_s = heal_window_s
        self._on_job_timed = on_job_timed
        self._job_times: list[tuple[float, float, float, str]] = []  # reported by the worker, not recorded yet
        self._on_queue_length = on_queue_length
        self._queue_length: int | None = None  # reported by the worker, not recorded yet
        self._lock = threading.Lock()  # guards the fields below, shared by the keeper thread and Triton's
        self._requests: dict[str, Request] = {}
        self._link: TensorLink | None = None  # to the current worker, once its ranks have met
        self._worker_link: TensorLink | None = None  # to the current worker, from its start
        self._problem: str | None = "the ranks are starting"  # why requests wait or fail now; None while serving
        self._given_up: str | None = None
        self._worker: subprocess.Popen | None = None
        self._first_load_over = threading.Event()  # the first worker loaded, or this rank gave up
        self._first_start_over = threading.Event()  # the ranks met, or this rank gave up
        self._stopping = threading.Event()
        self._deaths: deque[float] = deque()  # when this rank's workers died, within the window
        self._heard = time.monotonic()  # when the worker last reported, or was handed work while it held none
        self._healing_since: float | None = None
        self._thread = threading.Thread(target=self._keep, name="mdtriton-worker-keeper", daemon=True)

    def start(self) -> "WorkerKeeper":
        self._thread.start()
        return self

    def wait_serving(self, timeout: float) -> bool:
        """Wait until this rank's first worker has loaded (however long that takes: a load that fails must fail
        Triton's load of this instance), then until the ranks have met; False if they had not (or cannot) within
        timeout."""
        self._first_load_over.wait()
        self._first_start_over.wait(timeout)
        return self.serving

    @property
    def serving(self) -> bool:
        return self._link is not None

    @property
    def given_up(self) -> str | None:
        return self._given_up

    def status(self) -> str:
        """Why requests wait or fail now ("" while serving)."""
        return self._problem or ""

    def submit(self, inputs: dict[str, torch.Tensor], deadline: float,
               on_progress: ProgressListener | None = None) -> Request:
        """Queue a request; it runs as soon as the ranks serve; its `answer` gets the outputs, RequestError if the ranks
        refuse it (NaN or infinity in its inputs, an adapter that cannot be used), or JobFailed if its job failed on a
        rank before any collective. Raises RanksUnavailable if the ranks never serve again.
        deadline: the request's time.monotonic() by which the ranks must answer it, which travels with its job to the
        worker; on_progress: called, on the keeper thread, with the steps the engine reports (pipelines do)."""
        request = Request(inputs, deadline=deadline, on_progress=on_progress)
        with self._lock:
            if self._given_up or self._stopping.is_set():
                raise RanksUnavailable(self._given_up or "the model is being unloaded")
            self._requests[request.id] = request
            if self._link is not None:
                self._send(request)
        return request

    def give_up(self, request: Request, reason: str) -> None:
        """Forget a request whose caller stopped waiting (reason: cancelled, or past its deadline); the worker, if it
        holds it, drops its job or stops it after its next step, and it is forgotten once the worker says so (until
        then it still counts as work the worker holds)."""
        with self._lock:
            request.abandoned = True
            if not request.held:
                self._requests.pop(request.id, None)
            elif self._link is not None:  # else its worker has ended: the healing forgets the request
                try:
                    send(self._link, Cancel(request.id, reason))
                except OSError:
                    pass  # the worker has died: likewise

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the worker (the model is unloading): it leaves its epoch, so the others end without waiting."""
        with self._lock:  # the keeper thread starts no worker after this (see _start_worker)
            self._stopping.set()
            link, worker = self._worker_link, self._worker
        if link is not None:
            try:
                send(link, Stop())
            except OSError:
                pass
        if worker is not None:
            try:
                worker.wait(timeout)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        self._thread.join(timeout)

    # --- the keeper thread -----------------------------------------------------------------------------------

    def _send(self, request: Request) -> None:
        """Hand a request to the current worker (under the lock); a send to a worker that just died is retried by
        the next healing."""
        try:
            if not any(other.held for other in self._requests.values()):
                self._heard = time.monotonic()  # idle until now: it has not been quiet while holding work
            send(self._link, RunRequest(request.id, request.deadline, request.inputs))
            request.held = True
        except OSError:
            pass

    def _keep(self) -> None:
        """Start workers, one after another, as long as they should serve."""
        try:
            while True:
                started = self._start_worker()
                if started is None:
                    self._fail_all("the model is being unloaded")
                    return
                worker, link = started
                ending, members = self._serve(worker, link)
                self._record_job_times()
                link.close()
                try:
                    worker.wait(PEER_EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
                with self._lock:
                    self._link = self._worker_link = self._worker = None
                if not self._heal(worker, ending, members):
                    return
        except Exception as error:  # noqa: BLE001 - e.g. no Python to start a worker with: say so in every answer
            log.exception("rank %d: cannot keep a worker running", self.rank)
            self._fail_all(f"rank {self.rank} cannot keep a worker running: {type(error).__name__}: {error}")
        finally:
            self._first_load_over.set()
            self._first_start_over.set()

    def _heal(self, worker: subprocess.Popen, ending: Ended | GivenUp | None, members: dict[int, int]) -> bool:
        """After a worker has ended (its last word: `ending`, None if it died without one): get ready for the next
        one and say True, or say False if no worker is to serve again."""
        if self._healing_since is None:
            self._healing_since = time.monotonic()
        if self._stopping.is_set() or (ending is not None and ending.unloading):
            self._fail_all("the model is being unloaded")
            return False
        if isinstance(ending, GivenUp):
            log.error("rank %d: %s", self.rank, ending.reason)
            self._fail_all(ending.reason)
            return False
        why = ending.reason if ending is not None else (
            f"rank {self.rank}'s worker (pid {worker.pid}) died: {how_it_ended(worker.returncode)}")
        self._end_peers(members)
        self._fail_or_requeue(why)
        if ending is None and self._died_too_often():
            self._fail_all(f"rank {self.rank}'s worker died {len(self._deaths)} times within {self.heal_window_s:.0f} s "
                           f"(last: {how_it_ended(worker.returncode)}), so it is not restarted again: {RELOAD_ADVICE}")
            log.error("rank %d: %s", self.rank, self._given_up)
            self._tell_other_ranks()
            return False
        log.error("rank %d: healing: %s", self.rank, why)
        with self._lock:
            self._problem = f"the ranks are healing after a failure ({why}); requests wait for them"
        return True

    def _start_worker(self) -> tuple[subprocess.Popen, TensorLink] | None:
        """Start a worker and return it with its link; None once stop() has begun (so that stop() either sees the
        worker, and stops it, or no worker starts)."""
        with self._lock:
            if self._stopping.is_set():
                return None
            ours, theirs = socket.socketpair()
            with theirs:
                self._worker = subprocess.Popen(
                    [python_executable(), "-m", "mdtriton.backend.rank_worker", self.spec.to_json(),
                     str(theirs.fileno()), str(os.getpid())],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            self._worker_link = TensorLink(Connection(ours.detach()), lends_shared_files=True)
            return self._worker, self._worker_link

    def _serve(self, worker: subprocess.Popen, link: TensorLink) -> tuple[Ended | GivenUp | None, dict[int, int]]:
        """Relay between the worker and the requests until the worker ends; its last word (None if it died without
        one) and the members of its epoch (rank -> pid)."""
        members: dict[int, int] = {}
        while True:
            if not link.poll(WATCH_INTERVAL_S):
                self._record_job_times()
                if self._stuck():
                    log.error("rank %d: worker (pid %d) holds requests and reported no progress for %.0f s "
                              "(request_timeout_s; %s): killing it", self.rank, worker.pid, self.spec.request_timeout,
                              process_state(worker.pid).value)
                    worker.kill()
                continue
            try:
                message = receive(link)
            except (EOFError, OSError):
                return None, members
            self._heard = time.monotonic()
            match message:
                case Loaded():
                    self._first_load_over.set()
                case Serving(members=epoch_members):
                    members = epoch_members
                    self._now_serving(link)
                case Started(id=job_id):
                    with self._lock:
                        if job_id in self._requests:
                            self._requests[job_id].running = True
                    self._record_job_times()
                case Done(id=job_id, tensors=outputs):
                    with self._lock:
                        request = self._requests.pop(job_id, None)
                    if request is not None and not request.abandoned:
                        request.answer.set_result(outputs)
                case Refused(id=job_id, reason=reason):  # the request's fault: it fails now, never runs again
                    self._answer(job_id, RequestError(reason))
                case Failed(id=job_id, reason=reason):  # failed on a rank, ended by every rank: the ranks serve on
                    self._answer(job_id, JobFailed(reason))
                case Stopped(id=job_id, done=done, total=total):  # given up: its caller has its answer already
                    self._answer(job_id, JobStopped(done, total))
                case Progress(id=job_id, done=done, total=total):
                    with self._lock:
                        request = self._requests.get(job_id)
                    if (request is not None and not request.abandoned and request.on_progress is not None
                            and done > request.steps_reported):
                        request.steps_reported = done
                        request.on_progress(done, total)
                case JobTimed(communication=communication, compute=compute, waited=waited, group=group):
                    self._job_times.append((communication, compute, waited, group))
                case QueueLength(waiting=waiting):
                    self._queue_length = waiting
                case Ended() | GivenUp():  # the worker exits next
                    return message, members
                case _:
                    raise ProtocolError(f"a stub takes a worker's reports, not {message}")

    def _answer(self, job_id: str, error: Exception) -> None:
        """End a request the worker has ended, with error (unless its caller stopped waiting)."""
        with self._lock:
            request = self._requests.pop(job_id, None)
        if request is not None and not request.abandoned:
            request.answer.set_exception(error)

    def _record_job_times(self) -> None:
        """Hand the jobs' times to on_job_timed (Triton's metrics: each update is a round trip to the server process).

        Called when a job of this instance has started, when the worker has been quiet for WATCH_INTERVAL_S, and when
        it has ended: then no answer of this instance is on its way back to Triton (the worker reports a job's time
        just after its answer), whose response would otherwise wait behind these round trips (four of them made a
        probe model's responses 0.1 ms slower on a 2-core box). The counters lag by as much."""
        for times in self._job_times:
            self._on_job_timed(*times)
        self._job_times.clear()
        if self._queue_length is not None:
            self._on_queue_length(self._queue_length)
            self._queue_length = None

    def _now_serving(self, link: TensorLink) -> None:
        with self._lock:
            self._link, self._problem = link, None
            for request in self._requests.values():
                if not request.held:
                    self._send(request)
        if self._healing_since is not None:
            log.warning("rank %d: healed in %.2f s: the ranks serve again", self.rank,
                        time.monotonic() - self._healing_since)
            self._healing_since = None
        self._first_start_over.set()

    def _stuck(self) -> bool:
        """Whether the worker holds requests and has reported nothing (a step, a job's end) for request_timeout_s: it is
        stopped or stuck, and its peers may never notice (they only do when they wait for it in a collective)."""
        with self._lock:
            holds = any(request.held for request in self._requests.values())
        return holds and time.monotonic() - self._heard > self.spec.request_timeout

    def _end_peers(self, members: dict[int, int]) -> None:
        """Give the other workers of the ended epoch a moment to end by themselves; kill those still there."""
        deadline = time.monotonic() + PEER_EXIT_GRACE_S
        for rank, pid in members.items():
            if rank == self.rank:
                continue
            while process_state(pid) is ProcessState.RUNNING and time.monotonic() < deadline:
                time.sleep(0.05)
            if process_state(pid) is not ProcessState.EXITED and is_rank_worker(pid):
                log.error("rank %d: killing rank %d's worker (pid %d, %s) of the failed epoch", self.rank, rank,
                          pid, process_state(pid).value)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _fail_or_requeue(self, why: str) -> None:
        """After a failure: a request that was running at a second failure in a row fails; the others wait for the
        next worker."""
        with self._lock:
            for request in list(self._requests.values()):
                if request.running:
                    request.failures += 1
                if request.abandoned or request.failures >= 2:
                    del self._requests[request.id]
                if request.failures >= 2 and not request.abandoned:
                    request.answer.set_exception(PoisonRequest(
                        f"this request was running at two failures of the ranks in a row (the last: {why}); it is "
                        f"the likely cause, so it is not run again"))
                request.held, request.running = False, False

    def _died_too_often(self) -> bool:
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - self.heal_window_s:
            self._deaths.popleft()
        return len(self._deaths) > self.heal_limit

    def _fail_all(self, problem: str) -> None:
        """No worker will serve again: every request fails now, and every later one at once, with the problem."""
        with self._lock:
            self._given_up = self._problem = problem
            requests, self._requests = list(self._requests.values()), {}
        for request in requests:
            if not request.abandoned:
                request.answer.set_exception(RanksUnavailable(problem))

    def _tell_other_ranks(self) -> None:
        """The other ranks' new workers are waiting for this rank's: tell them, through the rendezvous, that it will
        not come (they give up at once, with this rank's reason)."""
        rendezvous = Rendezvous(Path(self.spec.rendezvous_dir), self.rank, self.world_size)
        rendezvous.fail(rendezvous.enter(), self._given_up)
