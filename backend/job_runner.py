"""Every rank runs every job, in one order: the data plane of the backend.

A JobRunner lives in each rank's stub process. Its thread forms a *generation* of the ranks: it joins
the rendezvous, forms the process group (NCCL on GPU, gloo on CPU), connects to rank 0's job hub, and
runs the jobs the hub orders: the rank that received the request broadcasts its inputs, every rank runs
the engine, and the receiving rank hands the outputs back to its waiting request.

A generation ends when anything goes wrong in it: a rank's process exits (the hub sees its socket
close), a collective fails or times out (a rank stopped or stuck), a job of this rank gets no turn
within the timeout (the hub's rank stopped or stuck), or a job raises on this rank (its peers may be
waiting in a collective that will never complete, so the job order cannot be trusted any more). Every
job still pending then fails at once, saying why, and the runner goes on:
- every member process is still alive: the same processes form the successor generation and serve
  again (automatic recovery); requests fail fast while they re-form;
- a member has exited: Triton does not restart the stub of a Python backend instance, so the model
  cannot serve until it is reloaded; every request fails fast saying so.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from mdtriton.backend.job_hub import HubLink, JobHub
from mdtriton.backend.process_state import describe_ranks
from mdtriton.backend.rendezvous import Generation, RankExited, RankFailedToLoad, Rendezvous, RendezvousTimeout
from mdtriton.engine.dtypes import TORCH_DTYPES, TRITON_TYPES
from mdtriton.engine.engine import Engine
from mdtriton.pipeline.progress import ProgressListener, progress_to

log = logging.getLogger("mdtriton.backend")

RELOAD_ADVICE = ("Triton does not restart the stub process of a Python backend instance, so this model cannot "
                 "serve until it is reloaded: unload and load it through the model control API (server started "
                 "with --model-control-mode=explicit), or restart the server")


class RanksUnavailable(Exception):
    """The ranks are not (or no longer) together, so no job can run now."""


# How often an idle runner checks the deadlines of its waiting jobs.
WATCH_INTERVAL_S = 0.2


@dataclass
class Job:
    inputs: dict[str, torch.Tensor]
    deadline: float  # time.monotonic() by which all ranks must have run it
    on_progress: ProgressListener | None = None  # told of the engine's progress while this rank runs the job
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    result: Future = field(default_factory=Future)


class JobRunner:
    def __init__(self, engine: Engine, rendezvous: Rendezvous, entered: int, join_timeout: float, timeout: float,
                 metrics, on_replaced: Callable[[], None]):
        """entered: the generation this rank entered as it started loading (Rendezvous.enter); timeout: the
        longest a job may wait for all ranks, and a collective for its peers, before the ranks are taken as
        lost; metrics: backend.metrics.RankMetrics, whose job() context counts and times each job;
        on_replaced: called (in the runner thread) when this load is broken and a new load has replaced it."""
        self.engine = engine
        self.comm = engine.comm
        self.rendezvous = rendezvous
        self._entered = entered
        self.join_timeout = join_timeout
        self.timeout = timeout
        self.metrics = metrics
        self._on_replaced = on_replaced
        self._lock = threading.Lock()  # guards the fields below, which the runner thread and requests share
        self._pending: dict[str, Job] = {}
        self._link: HubLink | None = None
        self._generation: Generation | None = None
        self._problem: str | None = None  # why no job can run now; None while serving or forming the first time
        self._ready = threading.Event()
        self._first_formation_over = threading.Event()  # the ranks met, or this rank gave up
        self._stopping = threading.Event()
        self._hub: JobHub | None = None
        self._jobs_run = 0  # by this rank, in every generation (only the runner thread counts)
        self._thread = threading.Thread(target=self._run, name="mdtriton-job-runner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every rank has joined; False if that did not happen (or cannot) within timeout."""
        self._first_formation_over.wait(timeout)
        return self._ready.is_set()

    @property
    def gave_up(self) -> str | None:
        """Why this rank stopped trying to form its first generation (e.g. another rank could not load), if it did."""
        with self._lock:
            return self._problem if self._first_formation_over.is_set() and not self._ready.is_set() else None

    def submit(self, inputs: dict[str, torch.Tensor], on_progress: ProgressListener | None = None) -> Job:
        """Queue a job for all ranks; its `result` future gets the outputs, or RanksUnavailable by the deadline.
        on_progress: called, on the runner thread, with the steps the engine reports (pipelines do).

        Fails at once (RanksUnavailable) while the ranks are apart; only before the first generation has
        formed does it wait, up to the timeout, for the other ranks to join.
        """
        self._first_formation_over.wait(self.timeout)
        job = Job(inputs, deadline=time.monotonic() + self.timeout, on_progress=on_progress)
        with self._lock:
            if not self._ready.is_set():
                raise RanksUnavailable(self._problem or f"not all {self.comm.plan.world_size} ranks have joined within "
                                       f"{self.timeout:.0f} s; check the server log of the other instances")
            self._pending[job.id] = job
            link = self._link
        header = [[name, TRITON_TYPES[t.dtype], list(t.shape)] for name, t in inputs.items()]
        try:
            link.send({"type": "submit", "job": job.id, "origin": self.comm.rank, "inputs": header})
        except OSError as error:
            with self._lock:
                self._pending.pop(job.id, None)
            # The hub has gone, so this generation is ending: give the runner a moment to say why.
            deadline = time.monotonic() + 1.0
            while self._ready.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._problem:
                raise RanksUnavailable(self._problem) from None
            # The runner may still be blocked in a collective with the lost rank (NCCL waits out its timeout):
            # say which rank is gone, if one is.
            generation = self._generation
            lost = describe_ranks(generation.members, exclude=self.comm.rank) if generation else ""
            raise RanksUnavailable(f"{lost}. {RELOAD_ADVICE}" if "exited" in lost else
                                   f"lost the connection to rank 0's job hub: {error}") from None
        return job

    def ranks_not_running(self) -> str:
        """The ranks of the current (or last) generation that are stopped or gone, as one phrase ("" if none)."""
        generation = self._generation
        return describe_ranks(generation.members, exclude=self.comm.rank) if generation else ""

    def stop(self, timeout: float = 10.0) -> None:
        """Leave (the model is unloading): the hub tells the other ranks, who stop without waiting on us."""
        self._stopping.set()
        with self._lock:
            link = self._link
        if link is not None:
            try:
                link.send({"type": "leave", "reason": "the model is being unloaded", "unloading": True})
            except OSError:
                pass
        self._thread.join(timeout)
        # The runner thread leaves its generation when it ends; if it is still stuck (in a collective with a
        # stopped rank), leave from here so the rendezvous area is cleaned up anyway.
        generation = self._generation
        if self._thread.is_alive() and generation is not None:
            self.rendezvous.leave(generation.number)

    def _run(self) -> None:
        if self.comm.device.type == "cuda":
            torch.cuda.set_device(self.comm.device)
        first = generation = None
        failures_in_a_row = 0
        while not self._stopping.is_set():
            try:
                if generation is None:
                    first = generation = self.rendezvous.join(self.join_timeout, self._stopping, self._entered)
                else:
                    generation = self.rendezvous.reform(generation, self._stopping)
            except RankExited as error:
                self._give_up(f"{error}. {RELOAD_ADVICE}")
                # Triton 2.51 never finalizes the other instances of a model one of whose stubs died after a
                # request reached it (its unload hangs), so this process would outlive the reload that
                # replaces it, holding its memory: give the memory back once the new load's ranks meet.
                if self.rendezvous.wait_for_newer_load(first.number, self._stopping):
                    self._on_replaced()
                return
            except RankFailedToLoad as error:
                self._give_up(f"{error}; this model version is not served")
                return
            except RendezvousTimeout as error:
                if not self._stopping.is_set():
                    self._give_up(f"rank {self.comm.rank} could not join the other ranks: {error}")
                return
            jobs_before = self._jobs_run
            reason = self._serve(generation)
            self._end_generation(generation, reason)
            # A generation that ends before running a single job, again and again, is a lasting fault (not a
            # lost rank): back off rather than spin.
            failures_in_a_row = failures_in_a_row + 1 if self._jobs_run == jobs_before else 0
            self._stopping.wait(min(0.1 * 2 ** failures_in_a_row, 5.0) if failures_in_a_row > 1 else 0)

    def _serve(self, generation: Generation) -> str:
        """Form the process group of this generation and run its jobs until it ends; return why it ended."""
        rank = self.comm.rank
        try:
            self.comm.connect(generation.store_path, self.timeout)
            if rank == 0:
                self._hub = JobHub(generation.hub_address, generation.token, self.comm.plan.world_size).start()
            link = HubLink(generation.hub_address, generation.token, rank, self.join_timeout)
            with self._lock:
                self._link, self._generation, self._problem = link, generation, None
                self._ready.set()
            self._first_formation_over.set()
            log.info("rank %d joined generation %d of %s", rank, generation.number, self.comm.plan)
            while True:
                if not link.poll(WATCH_INTERVAL_S):
                    if self._overdue():
                        return f"a job of rank {rank} got no turn from rank 0's job hub within {self.timeout:.0f} s"
                    continue
                message = link.receive()
                if message["type"] == "stop":
                    if message["unloading"]:
                        # Triton unloads every instance of the model: this rank's finalize follows.
                        self._stopping.set()
                    return message["reason"]
                with self.metrics.job():
                    self._execute(message)
        except (EOFError, ConnectionError):
            return "the model is being unloaded" if self._stopping.is_set() else "rank 0's job hub went away"
        except Exception as error:  # noqa: BLE001 - any failure ends the generation; its reason reaches every request
            return f"rank {rank}: {error}"

    def _execute(self, message: dict) -> None:
        """Run one job with all ranks.

        Any exception leaves the collective order unknown, so it ends the generation; the job stays in
        _pending until it has its outputs, so the end of the generation fails it with the reason.
        """
        origin = message["origin"]
        with self._lock:
            job = self._pending[message["job"]] if origin == self.comm.rank else None
        inputs = {}
        for name, data_type, shape in message["inputs"]:
            if job is not None:
                tensor = job.inputs[name].to(self.comm.device).contiguous()
            else:
                tensor = torch.empty(shape, dtype=TORCH_DTYPES[data_type], device=self.comm.device)
            inputs[name] = self.comm.broadcast(tensor, src=origin)
        with progress_to(job.on_progress if job is not None else None):
            outputs = self.engine.forward(inputs)
        if self.comm.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self._jobs_run += 1
        if job is not None:
            with self._lock:
                del self._pending[job.id]
            job.result.set_result(outputs)

    def _end_generation(self, generation: Generation, reason: str) -> None:
        """Fail every pending job with the reason, tell the others (via the hub), and free the communicator."""
        lost = self._lost_ranks(generation)
        what = f"{reason}; {lost}" if lost else reason
        with self._lock:
            self._ready.clear()
            if self._stopping.is_set():
                self._problem = "the model is being unloaded"
            else:
                self._problem = (f"the ranks are re-forming after a failure ({what}); requests fail until every "
                                 "rank is back")
            jobs, self._pending = list(self._pending.values()), {}
            link, self._link = self._link, None
        if not self._stopping.is_set():
            log.error("rank %d: generation %d ended: %s", self.comm.rank, generation.number, what)
        for job in jobs:
            job.result.set_exception(RanksUnavailable(f"the ranks lost each other before this request completed: "
                                                      f"{what}"))
        if link is not None:
            try:
                link.send({"type": "leave", "reason": reason, "unloading": self._stopping.is_set()})
            except OSError:
                pass
            link.close()
        if self._hub is not None:
            self._hub.stop()
            self._hub = None
        try:
            self.comm.disconnect()
        except Exception as error:  # noqa: BLE001 - a failed group may not tear down cleanly; the next one is new
            log.warning("rank %d: tearing down the process group of generation %d: %s",
                        self.comm.rank, generation.number, error)
        self.rendezvous.leave(generation.number)

    def _overdue(self) -> bool:
        """Whether a job of this rank is past its deadline (checked while no job runs, so it was never ordered)."""
        now = time.monotonic()
        with self._lock:
            return any(job.deadline < now for job in self._pending.values())

    def _lost_ranks(self, generation: Generation) -> str:
        """The members that exited or stopped, as one phrase; a killed peer's socket can close a moment before
        its process shows as exited, so look again for up to half a second before answering "none"."""
        for _ in range(10):
            lost = describe_ranks(generation.members, exclude=self.comm.rank)
            if lost or self._stopping.is_set():
                return lost
            time.sleep(0.05)
        return ""

    def _give_up(self, problem: str) -> None:
        with self._lock:
            self._problem = problem
        self._first_formation_over.set()
        log.error("rank %d: %s", self.comm.rank, problem)
