"""Every rank runs every job, in one order: the data plane of a rank's worker process (backend/rank_worker.py).

A JobRunner serves one *epoch* of the ranks: its thread joins the rendezvous, forms the process group
(NCCL on GPU, gloo on CPU), connects to rank 0's job hub, and runs the jobs the hub orders: the rank that
received the request broadcasts its inputs, every rank runs the engine, and rank 0's outputs answer the
receiving rank's waiting request. A world of one rank has no hub: its jobs run in the order they come
(job_hub.SingleRankLink), with the same checks, timeouts and endings.

Before the rank that received a request submits its job to the hub, the runner thread copies the inputs to its
device and checks there that they are finite (mdtriton.engine.request_check.check_finite): a request with NaN or
infinity fails with RequestError before any other rank hears of it, and the epoch goes on. The runner thread
is the only one that uses the device while serving (while it captures a CUDA graph, another thread's device work
could break the capture).

A job ends early on every rank at once, and the epoch goes on, in three ways:
- its request no longer waits (cancelled by its client, or past its deadline; the stub says so, `cancel`): before it
  starts, the receiving rank tells the others as the job's turn comes (one broadcast) and every rank skips it; once
  started, a pipeline's ranks stop after the next step (mdtriton.engine.job_control);
- a pipeline's job fails on a rank before any collective of it (an adapter that cannot be read, a check of
  diffusers'): every rank ends it there (JobFailed), and the request is answered with the failure.

The epoch ends when anything else goes wrong in it: a rank's process exits (the hub sees its socket close; on
NCCL, which has no error for a lost peer, every rank also watches the others' processes and aborts its groups, so
that a rank blocked in a collective with the dead one ends at once), a collective fails or times out (a rank
stopped or stuck), the hub orders nothing for the timeout while a job of this rank waits (the hub's rank stopped or
stuck; a busy hub orders other jobs, so a long queue is no sign of it), or a job raises on this rank anywhere else
(its peers may be waiting in a collective that will never complete, so the job order cannot be trusted any more).
Every job still pending then fails at once, saying why, and the runner ends: its worker exits, and the stub starts a
new worker, which meets the other ranks' new workers in a new epoch (backend/worker_keeper.py).

An elastic model (ParallelPlan.elastic) runs each job on the group of ranks the hub chose (backend/job_scheduler.py),
with the engine bound to that group's communicator (Communicator.bound_to); jobs on disjoint groups run at once. The
origin need not take part: its checked inputs travel with its Submit, in host memory, through the hub to the group,
and the group's leader (its first rank) sends the answer, and its progress, back through the hub. A thread of the
runner reads the hub's link: it hands the runner thread the jobs to run and completes this rank's waiting jobs with
their answers, so an answer never waits for a job this rank runs meanwhile. A cancelled job is withdrawn at the hub:
dropped if it waits, or stopped by its group after the next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import Pipe
from multiprocessing.connection import wait

import torch

from mdtriton.backend.job_hub import HubLink, JobHub, SingleRankLink
from mdtriton.backend.job_scheduler import MIN_SPEEDUP
from mdtriton.backend.job_timer import JobTimer
from mdtriton.backend.messages import (EndEpoch, Finished, Leave, Message, Progress, ProtocolError,
                                       RanksUnavailable, Result, Run, Submit, Withdraw)
from mdtriton.backend.process_state import ProcessState, describe_ranks, process_state
from mdtriton.backend.rendezvous import Epoch, RankFailedToLoad, Rendezvous, RendezvousTimeout
from mdtriton.engine.comm import CommunicationError, Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES, TRITON_TYPES
from mdtriton.engine.engine import Engine
from mdtriton.engine.job_control import JobControl, JobFailed, JobStopped, controlled_by, wait_for_device
from mdtriton.engine.request_check import RequestError, check_finite

log = logging.getLogger("mdtriton.backend")


# The rank whose outputs answer every request, whichever rank received it (JobRunner._answer_of_rank_0).
ANSWERING_RANK = 0
# How long an unloading worker waits for its epoch to end before it leaves anyway: less than its stub waits
# for it to exit (worker_keeper.STOP_TIMEOUT_S, 10 s).
LEAVE_TIMEOUT_S = 5.0
# How often an idle runner looks whether the job hub has gone quiet while a job of this rank waits.
WATCH_INTERVAL_S = 0.2


@dataclass
class RankJob:
    """A request's job as one rank's runner holds it: its inputs, deadline and result, from submission to its end."""

    inputs: dict[str, torch.Tensor]
    deadline: float  # time.monotonic() by which all ranks must have run it: the request's, set by its stub
    id: str  # the stub's id of the request
    result: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)  # when this rank's worker took it
    on_device: dict[str, torch.Tensor] | None = None  # the inputs copied to this rank's device, once checked
    stop_reason: str | None = None  # set when its request no longer waits for it (cancel)
    submitted_to_hub: bool = False  # an elastic model's job, checked and sent to the hub
    started: bool = False  # an elastic model's job that the hub has started, on whichever group

    def not_awaited(self) -> str | None:
        """Why its request no longer waits for this job (it should not start, or go on), or None."""
        if self.stop_reason is None and self.deadline < time.monotonic():
            self.stop_reason = "past its deadline"
        return self.stop_reason


@dataclass(frozen=True)
class EpochEnd:
    """How this runner's epoch ended (or why it never formed)."""

    reason: str
    given_up: bool = False  # it never formed and never will: another rank could not load, or joining timed out
    unloading: bool = False  # the model is being unloaded


class JobRunner:
    def __init__(self, engine: Engine, comm: Communicator, rendezvous: Rendezvous, entered: int, join_timeout: float,
                 timeout: float, timer: JobTimer, on_serving: Callable[[Epoch], None],
                 on_started: Callable[[str], None], on_progress: Callable[[str, int, int], None],
                 on_queue_length: Callable[[int], None], min_speedup: float = MIN_SPEEDUP):
        """comm: the communicator the engine was loaded with (the runner forms its groups over it, and broadcasts
        inputs and rank 0's outputs); entered: the epoch this rank entered as it started loading
        (Rendezvous.enter); timeout: the longest a collective waits for its peers before the ranks are taken as
        lost (each job brings its request's own deadline); timer: wraps each job (backend/job_timer.py);
        on_serving(epoch): called once the ranks have met; on_started(job id): called as a job this rank
        submitted starts running; on_progress(job id, done, total): called after each step of every job the engine
        reports steps of (pipelines do), whichever rank submitted it (all in the runner thread; an elastic model's
        also in the thread that reads the hub's link); on_queue_length(waiting): an elastic model's hub, on rank 0,
        says how many jobs wait for a group (in the hub's thread); min_speedup: what a larger group must gain for a
        lone job of an elastic model to take it (backend/job_scheduler.py)."""
        self.engine = engine
        self.comm = comm
        # This rank and whether the plan is elastic, for the threads beside the runner thread: while a job runs bound
        # to a group (Communicator.bound_to), the communicator's rank and plan are the group's.
        self.rank = comm.rank
        self.elastic = comm.plan.elastic
        self.rendezvous = rendezvous
        self._entered = entered
        self.join_timeout = join_timeout
        self.timeout = timeout
        self.timer = timer
        self._on_serving = on_serving
        self._on_started = on_started
        self._on_progress = on_progress
        self._on_queue_length = on_queue_length
        self.min_speedup = min_speedup
        self._lock = threading.Lock()  # guards the fields below, which the runner thread and submitters share
        self._pending: dict[str, RankJob] = {}
        self._link: HubLink | SingleRankLink | None = None
        # The ids of the jobs this rank receives, for the runner thread to check and submit to the hub.
        self._arrivals, self._arrivals_writer = Pipe(duplex=False)
        self._end: EpochEnd | None = None
        self._ended = threading.Event()
        self._aborted = threading.Event()  # set by the peer watcher (NCCL) before it aborts the groups
        self._stopping = threading.Event()
        self._epoch: Epoch | None = None
        self._hub: JobHub | None = None
        self._hub_heard = time.monotonic()  # when the job order last moved: a job ordered, or ended, on this rank
        # An elastic model's: the hub's orders for the runner thread, handed over by the thread that reads the link.
        self._orders: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._orders_ready, self._orders_writer = Pipe(duplex=False)
        self._group_job: RankJob | None = None  # the elastic job this rank runs now (the hub may withdraw it)
        self._thread = threading.Thread(target=self._run, name="mdtriton-job-runner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_ended(self) -> EpochEnd:
        """Block until this runner's epoch has ended (or could not form); say how."""
        self._ended.wait()
        return self._end

    def submit(self, inputs: dict[str, torch.Tensor], job_id: str, deadline: float) -> RankJob:
        """Queue a job for all ranks; its `result` future gets the outputs, RequestError if its inputs hold NaN or
        infinity, JobFailed or JobStopped if every rank ended it early (module doc), or RanksUnavailable if the
        epoch ends first. Raises RanksUnavailable if the epoch is not serving. deadline: the request's, a
        time.monotonic() set by its stub (backend/messages.py, RunRequest: one clock for every process of the
        machine): a job that has not started by then is dropped."""
        job = RankJob(inputs, deadline=deadline, id=job_id)
        with self._lock:
            if self._link is None:
                raise RanksUnavailable(self._end.reason if self._end else "the ranks have not met yet")
            self._pending[job.id] = job
            link = self._link
            if not self.elastic:
                # Never blocks: a stub has about one request in flight (Triton hands it one per execute), far below
                # what the pipe holds (64 KiB, 36 bytes a job).
                self._arrivals_writer.send_bytes(job.id.encode())
        if self.elastic:
            self._check_and_submit_elastic(job, link)
        return job

    def cancel(self, job_id: str, reason: str) -> None:
        """The request of a job of this rank no longer waits for it (reason: why): the job is dropped if it has not
        started, and a pipeline's job stops after its next step (every rank together)."""
        with self._lock:
            job = self._pending.get(job_id)
            if job is not None and job.stop_reason is None:
                job.stop_reason = reason
            link = self._link
        if job is not None and job.submitted_to_hub and link is not None:
            try:
                link.send(Withdraw(job_id, reason))  # submitted: the hub drops it, or its group stops it
            except OSError:
                pass  # the epoch is ending: the job fails with it

    def stop(self, timeout: float = LEAVE_TIMEOUT_S) -> None:
        """Leave (the model is unloading): the hub tells the other ranks, who stop without waiting on us. If the
        epoch has not ended within timeout (its teardown stuck, e.g. an NCCL abort), leave the rendezvous area
        from here, so that this worker exits, and the area is cleaned, before its stub would kill it."""
        self._stopping.set()
        with self._lock:
            link = self._link
        if link is not None:
            try:
                link.send(Leave("the model is being unloaded", True))
            except OSError:
                pass
        self._thread.join(timeout)
        # The runner thread leaves its epoch when it ends; if it is still stuck (in a collective with a
        # stopped rank), leave from here so the rendezvous area is cleaned up anyway.
        epoch = self._epoch
        if self._thread.is_alive() and epoch is not None:
            self.rendezvous.leave(epoch.number)
        self._finish(EpochEnd("the model is being unloaded", unloading=True))

    def _run(self) -> None:
        if self.comm.device.type == "cuda":
            torch.cuda.set_device(self.comm.device)
        try:
            epoch = self.rendezvous.join(self.join_timeout, self._stopping, self._entered)
        except RankFailedToLoad as error:
            self._finish(EpochEnd(f"{error}; this model version is not served", given_up=True))
            return
        except RendezvousTimeout as error:
            self._finish(EpochEnd(f"rank {self.comm.rank} could not join the other ranks: {error}",
                                  given_up=not self._stopping.is_set(), unloading=self._stopping.is_set()))
            return
        self._epoch = epoch
        reason = self._serve(epoch)
        self._finish(self._end_epoch(epoch, reason))

    def _finish(self, end: EpochEnd) -> None:
        with self._lock:
            if self._end is None:
                self._end = end
        self._ended.set()

    def _serve(self, epoch: Epoch) -> str:
        """Form the process group of this epoch and run its jobs until it ends; return why it ended."""
        rank = self.comm.rank
        serving, watcher = threading.Event(), None
        serving.set()
        try:
            started = time.monotonic()
            self.comm.connect(epoch.store_path, self.timeout)
            link = self._connect_to_hub(epoch)
            with self._lock:
                self._link = link
            # An elastic plan forms every group of every size here: the time it adds is in this line.
            log.info("rank %d joined epoch %d of %s (process groups formed in %.2f s)", rank, epoch.number,
                     self.comm.plan, time.monotonic() - started)
            self._on_serving(epoch)
            if self.comm.device.type == "cuda" and self.comm.plan.world_size > 1:
                watcher = threading.Thread(target=self._abort_when_a_peer_exits, args=(epoch, serving),
                                           name="mdtriton-peer-watch", daemon=True)
                watcher.start()
            orders = link
            if self.comm.plan.elastic:
                threading.Thread(target=self._read_hub, args=(link,), name="mdtriton-hub-reader", daemon=True).start()
                orders = self._orders_ready
            while True:
                ready = wait([self._arrivals, orders], WATCH_INTERVAL_S)
                if not ready:
                    if self._hub_quiet():
                        return (f"rank 0's job hub ordered no job for {self.timeout:.0f} s while a job of rank {rank} "
                                "waited (rank 0 stopped or stuck)")
                    continue
                if self._arrivals in ready:
                    self._check_and_submit(self._arrivals.recv_bytes().decode(), link)
                if orders not in ready:
                    continue
                if orders is link:
                    message = link.receive()
                    self._hub_heard = time.monotonic()
                else:
                    orders.recv_bytes()
                    message = self._orders.get()
                match message:
                    case EndEpoch(reason=reason, unloading=unloading):
                        if unloading:
                            # Triton unloads every instance of the model: this rank's own stop follows.
                            self._stopping.set()
                        return reason
                    case Run() as run if self.comm.plan.elastic:
                        self._execute_in_group(run, link)
                        self._hub_heard = time.monotonic()
                    case Run() as run:
                        self._execute(run)
                        self._hub_heard = time.monotonic()
                    case _:
                        raise ProtocolError(f"a runner takes jobs to run and the epoch's end, not {message}")
        except (EOFError, ConnectionError):
            return "the model is being unloaded" if self._stopping.is_set() else "rank 0's job hub went away"
        except CommunicationError as error:
            return f"rank {rank}: {error}"
        except Exception as error:  # noqa: BLE001 - any failure ends the epoch; its reason goes to the stub
            return f"rank {rank}: {type(error).__name__}: {error}"
        finally:
            serving.clear()
            if watcher is not None:
                watcher.join()

    def _connect_to_hub(self, epoch: Epoch) -> HubLink | SingleRankLink:
        """This rank's link to the job order of the epoch: rank 0 starts the hub first. A world of one rank
        has no order to agree on: its jobs come straight back to it (SingleRankLink), without a hub."""
        if self.comm.plan.world_size == 1:
            return SingleRankLink()
        plan = self.comm.plan
        group_times = None
        if plan.elastic:  # every rank together, before any job: the table the hub sizes lone jobs' groups by
            started = time.monotonic()
            group_times = self.engine.measure_group_times()
            log.info("rank %d timed the forward on every group size in %.2f s", self.comm.rank,
                     time.monotonic() - started)
        if self.comm.rank == 0:
            partitions = {size: plan.group_partition(size) for size in plan.group_sizes()} if plan.elastic else None
            self._hub = JobHub(epoch.hub_address, epoch.token, plan.world_size, partitions,
                               self._on_queue_length, group_times, self.min_speedup).start()
        return HubLink(epoch.hub_address, epoch.token, self.comm.rank, self.join_timeout)

    def _abort_when_a_peer_exits(self, epoch: Epoch, serving: threading.Event) -> None:
        """NCCL only: abort this epoch's groups as soon as another member's process has exited.

        NCCL has no error for a lost peer: a collective with a killed rank blocks until its timeout, and the hub's
        EndEpoch waits unread meanwhile. Without this watch, the dead worker's stub would kill this worker after
        its grace (worker_keeper.PEER_EXIT_GRACE_S): healing would start 2 s later, the log would call this rank killed
        rather than say why, and its stub would count a death of its own against heal_limit. Aborted, the blocked
        collective raises within WATCH_INTERVAL_S, this worker ends its epoch like a gloo rank does (gloo
        fails such a collective at once by itself), and its requests run on the next one. A stopped peer is left
        to the timeout, as it may be resumed.
        """
        while serving.is_set():
            exited = [rank for rank, pid in epoch.members.items()
                      if rank != self.rank and process_state(pid) is ProcessState.EXITED]
            if exited:
                log.error("rank %d: rank %s of epoch %d exited; aborting the process groups", self.rank,
                          ", ".join(map(str, exited)), epoch.number)
                self._aborted.set()
                self.comm.disconnect()
                return
            time.sleep(WATCH_INTERVAL_S)

    def _check_and_submit(self, job_id: str, link: HubLink | SingleRankLink) -> None:
        """Copy the inputs of a job this rank received to its device, check that they are finite there, and submit
        the job to the hub. A job whose inputs are not fails with RequestError: no other rank hears of it."""
        with self._lock:
            job = self._pending[job_id]
        if job.not_awaited() is not None:
            self._drop(job)
            return
        job.on_device = self._fresh_copy(job.inputs)
        try:
            check_finite(job.on_device)
        except RequestError as error:
            self._end_job(job, error)
            return
        header = [[name, TRITON_TYPES[t.dtype], list(t.shape)] for name, t in job.on_device.items()]
        try:
            link.send(Submit(job.id, self.comm.rank, header))
        except OSError:
            pass  # the hub has gone, so this epoch is ending: the job fails with it

    def _check_and_submit_elastic(self, job: RankJob, link: HubLink) -> None:
        """An elastic model's job: check its inputs in host memory and submit them with it, in the calling thread (the
        worker's, which takes the stub's jobs), not the runner thread: that may run another group's job meanwhile, and
        the hub must see every job that waits. The group that runs it copies the inputs to its devices."""
        if job.not_awaited() is not None:
            self._drop(job)
            return
        try:
            check_finite(job.inputs)
        except RequestError as error:
            self._end_job(job, error)
            return
        header = [[name, TRITON_TYPES[t.dtype], list(t.shape)] for name, t in job.inputs.items()]
        job.submitted_to_hub = True
        try:
            link.send(Submit(job.id, self.rank, header, job.deadline, job.inputs,
                             self.engine.request_tokens(job.inputs)))
        except OSError:
            pass  # the hub has gone, so this epoch is ending: the job fails with it

    def _fresh_copy(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inputs in fresh tensors on this rank's device.

        Every rank runs a job on fresh tensors, the origin's included: the request's own memory has another
        alignment, and CPU kernels round differently on differently aligned data (~1e-6 in float32), so the origin
        would compute other bits than its peers. On a GPU the copy reads page-locked shared memory
        (backend/tensor_transfer.py) asynchronously; check_finite waits for it."""
        copies = {}
        for name, tensor in inputs.items():
            copies[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.comm.device)
            copies[name].copy_(tensor, non_blocking=True)
        return copies

    def _execute(self, run: Run) -> None:
        """Run one job with all ranks, or skip it with all ranks if its request no longer waits.

        A job that every rank ends at the same point (JobFailed, JobStopped) leaves the order as it was: its request
        is answered with that ending. Any other exception leaves the collective order unknown, so it ends the
        epoch; the job stays in _pending until it has its outputs, so the end of the epoch fails it with
        the reason.
        """
        origin = run.origin
        with self._lock:
            job = self._pending[run.job] if origin == self.comm.rank else None
        if self._skip(job, origin):
            if job is not None:
                self._drop(job)
            return
        if job is not None:
            self._on_started(job.id)
            self.timer.waited(time.monotonic() - job.submitted)
        control = JobControl(on_progress=partial(self._on_progress, run.job), timeout=self.timeout,
                             stop_requested=lambda: job is not None and job.not_awaited() is not None)
        with self.timer.job():
            inputs = {}
            for name, data_type, shape in run.inputs:
                # The origin broadcasts its checked copy; the others receive into fresh tensors of the same kind.
                tensor = job.on_device[name] if job is not None else torch.empty(
                    shape, dtype=TORCH_DTYPES[data_type], device=self.comm.device)
                inputs[name] = self.comm.broadcast(tensor, src=origin)
            try:
                with controlled_by(control):
                    outcome = self._answer_of_rank_0(origin, self.engine.forward(inputs))
            except (JobFailed, JobStopped) as ended:  # every rank ended the job at the same point: the order holds
                outcome = ended
            if self.comm.device.type == "cuda" and self.comm.plan.world_size == 1:
                torch.cuda.current_stream().synchronize()  # no collective, nothing to wait for but this GPU
            elif self.comm.device.type == "cuda":
                wait_for_device(self.timeout)
                if self._aborted.is_set():
                    # The kernels of an aborted collective end without its data: these outputs are not the answer.
                    raise CommunicationError("the process groups were aborted during the job (a peer exited)")
        if job is None:
            return
        if isinstance(outcome, JobStopped):
            log.info("rank %d: request %s %s: %s", self.comm.rank, job.id, outcome, job.stop_reason)
        elif isinstance(outcome, JobFailed):
            log.warning("rank %d: request %s failed on every rank before its collectives (the ranks serve on): %s",
                        self.comm.rank, job.id, outcome)
        self._end_job(job, outcome)

    def _read_hub(self, link: HubLink) -> None:
        """An elastic model's reader of the hub's link (its own thread): the jobs to run and the epoch's end go
        to the runner thread; answers and progress of this rank's jobs, run by other groups, go to their requests at
        once; a withdrawal stops the job this rank leads."""
        while True:
            try:
                message = link.receive()
            except (EOFError, OSError, ProtocolError):
                message = EndEpoch("rank 0's job hub went away", False)
            self._hub_heard = time.monotonic()
            match message:
                case Run(job=job_id, group=group) if self.rank not in group:  # a job of this rank, started elsewhere
                    with self._lock:
                        job = self._pending.get(job_id)
                    if job is not None:
                        job.started = True
                        self._on_started(job_id)
                case Run() | EndEpoch():
                    self._orders.put(message)
                    try:
                        self._orders_writer.send_bytes(b"")
                    except OSError:
                        return  # the epoch has ended
                    if isinstance(message, EndEpoch):
                        return
                case Result() as result:
                    self._take_result(result)
                case Progress(id=job_id, done=done, total=total):
                    self._on_progress(job_id, done, total)
                case Withdraw(job=job_id, reason=reason):
                    running = self._group_job
                    if running is not None and running.id == job_id and running.stop_reason is None:
                        running.stop_reason = reason
                case _:
                    self._orders.put(EndEpoch(f"rank 0's job hub sent {message}, not a job or an answer", False))
                    self._orders_writer.send_bytes(b"")
                    return

    def _execute_in_group(self, run: Run, link: HubLink) -> None:
        """Run an elastic model's job on its group (this rank among them), with the engine bound to the group, and tell
        the hub that this rank has finished it; the group's leader answers it (to this rank's waiting request, or
        through the hub to its origin's). Every rank of the group ends a job that fails or stops together (the order
        holds); anything else ends the epoch, as for every job."""
        leader = run.group[0] == self.comm.rank
        with self._lock:
            own = self._pending.get(run.job) if run.origin == self.comm.rank else None
        running = RankJob({}, deadline=run.deadline, id=run.job)
        self._group_job = running
        if own is not None:
            own.started = True
            self._on_started(own.id)
            self.timer.waited(time.monotonic() - own.submitted)

        def stop_requested() -> bool:
            return running.not_awaited() is not None or (own is not None and own.not_awaited() is not None)

        def on_progress(done: int, total: int) -> None:
            self._on_progress(run.job, done, total)
            if leader and run.origin not in run.group:
                try:
                    link.send(Progress(run.job, done, total))
                except OSError:
                    pass  # the hub has gone: the epoch is ending

        control = JobControl(on_progress=on_progress, timeout=self.timeout, stop_requested=stop_requested)
        with self.timer.job(run.job, run.group):
            inputs = self._fresh_copy(run.tensors)
            try:
                with controlled_by(control), self.comm.bound_to(len(run.group)):
                    outcome = self.engine.forward(inputs)
                    self.comm.check_device("the answer", *outcome.values())
            except (JobFailed, JobStopped) as ended:  # every rank of the group ended it at the same point
                outcome = ended
            if self.comm.device.type == "cuda":
                wait_for_device(self.timeout)
                if self._aborted.is_set():
                    raise CommunicationError("the process groups were aborted during the job (a peer exited)")
        self._group_job = None
        if isinstance(outcome, (JobFailed, JobStopped)):
            log.info("rank %d: request %s ended on ranks %s: %s %s", self.comm.rank, run.job, run.group,
                     type(outcome).__name__, outcome)
        try:
            if leader and own is not None:
                self._end_job(own, outcome)
            elif leader:
                link.send(result_of(run.job, outcome))
            link.send(Finished(run.job, self.comm.rank))
        except OSError:
            pass  # the hub has gone: the epoch is ending, and the request runs again on the next one

    def _take_result(self, result: Result) -> None:
        """Complete a job of this rank with the answer its group's leader sent (or the hub's word that it was
        dropped); called by the thread that reads the hub's link."""
        with self._lock:
            job = self._pending.get(result.job)
        if job is None:
            return
        match result.outcome:
            case "done":
                outcome = result.tensors
            case "stopped":
                log.info("rank %d: request %s stopped: %s", self.rank, job.id, result.reason or job.stop_reason)
                outcome = JobStopped(result.done, result.total)
            case "refused":
                outcome = JobFailed(result.reason, request_error=True)
            case _:
                log.warning("rank %d: request %s failed on every rank of its group (the ranks serve on): %s",
                            self.rank, job.id, result.reason)
                outcome = JobFailed(result.reason)
        self._end_job(job, outcome)

    def _skip(self, job: RankJob | None, origin: int) -> bool:
        """Whether every rank skips this job: the rank that received it says so as its turn comes, if its request no
        longer waits for it (one broadcast: no other rank knows)."""
        skip = job is not None and job.not_awaited() is not None
        if self.comm.plan.world_size == 1:
            return skip
        flag = self.comm.broadcast(torch.full((1,), int(skip), dtype=torch.int32, device=self.comm.device), origin)
        if self.comm.device.type == "cuda":
            wait_for_device(self.timeout)
        return bool(flag.item())

    def _drop(self, job: RankJob) -> None:
        """End a job of this rank that never started: its request no longer waits for it."""
        log.info("rank %d: request %s dropped before it started: %s", self.rank, job.id, job.stop_reason)
        self._end_job(job, JobStopped(0, 0))

    def _end_job(self, job: RankJob, outcome) -> None:
        """Forget a job of this rank and hand its request the outcome: its outputs, or the exception that ended it."""
        with self._lock:
            self._pending.pop(job.id, None)
        if isinstance(outcome, BaseException):
            job.result.set_exception(outcome)
        else:
            job.result.set_result(outcome)

    def _answer_of_rank_0(self, origin: int, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0's outputs, on every rank: the answer must not depend on which instance received the request.

        Every rank computes the full outputs from the same inputs, in the same fresh buffers, so they should agree;
        but nothing in the engine promises that every rank's last bits agree (a kernel may pick another algorithm
        on another rank's data layout or device). So rank 0's outputs are the answer: when another rank received
        the request, rank 0 broadcasts them (every rank knows the origin, so all take part or none do). The outputs must
        be on this rank's device (mdtriton.engine.comm, the device contract), whichever rank answers: checked here for
        every job, so an engine that breaks the contract fails every request, not only those another rank received."""
        self.comm.check_device("the answer", *outputs.values())
        if origin == ANSWERING_RANK:
            return outputs
        with torch.inference_mode():  # the engine's outputs are inference tensors; the broadcast writes into them
            return {name: self.comm.broadcast(value.contiguous(), src=ANSWERING_RANK) for name, value in outputs.items()}

    def _end_epoch(self, epoch: Epoch, reason: str) -> EpochEnd:
        """Fail every pending job with the reason, tell the others (via the hub), free the communicator and leave."""
        lost = self._lost_ranks(epoch)
        what = f"{reason}; {lost}" if lost else reason
        with self._lock:
            jobs, self._pending = list(self._pending.values()), {}
            link, self._link = self._link, None
            self._arrivals.close()  # submit() writes no more: the epoch no longer serves
            self._arrivals_writer.close()
        if not self._stopping.is_set():
            log.error("rank %d: epoch %d ended: %s", self.comm.rank, epoch.number, what)
        for job in jobs:
            job.result.set_exception(RanksUnavailable(f"the ranks lost each other before this request completed: "
                                                      f"{what}"))
        if link is not None:
            try:
                link.send(Leave(reason, self._stopping.is_set()))
            except OSError:
                pass
            link.close()
        if self._hub is not None:
            self._hub.stop()
            self._hub = None
        # Leave first: the area's files are ours to remove whatever the groups' teardown does (an NCCL abort has been
        # seen to take longer than an unloading stub waits).
        self.rendezvous.leave(epoch.number)
        started = time.monotonic()
        try:
            self.comm.disconnect()
        except Exception as error:  # noqa: BLE001 - a failed group may not tear down cleanly; the worker exits next
            log.warning("rank %d: tearing down the process group of epoch %d: %s",
                        self.comm.rank, epoch.number, error)
        log.info("rank %d: left epoch %d (process groups torn down in %.2f s)", self.comm.rank,
                 epoch.number, time.monotonic() - started)
        return EpochEnd(what, unloading=self._stopping.is_set())

    def _hub_quiet(self) -> bool:
        """Whether a job of this rank has waited for the hub's order for the timeout, while the order did not move
        (checked while no job runs): the hub is stopped or stuck. A job behind others is ordered when they are."""
        now = time.monotonic()
        with self._lock:
            waiting = [job.submitted for job in self._pending.values()
                       if (job.on_device is not None or job.submitted_to_hub) and not job.started]
        return bool(waiting) and now - max(min(waiting), self._hub_heard) > self.timeout

    def _lost_ranks(self, epoch: Epoch) -> str:
        """The members that exited or stopped, as one phrase; a killed peer's socket can close a moment before
        its process shows as exited, so look again for up to half a second before answering "none"."""
        for _ in range(10):
            lost = describe_ranks(epoch.members, exclude=self.comm.rank)
            if lost or self._stopping.is_set():
                return lost
            time.sleep(0.05)
        return ""


def result_of(job: str, outcome) -> Result:
    """The Result message that carries an elastic model's job's outcome (its outputs, in host memory, or how every
    rank of its group ended it) to its origin."""
    match outcome:
        case JobStopped(done=done, total=total):
            return Result(job, "stopped", done=done, total=total)
        case JobFailed(request_error=True):
            return Result(job, "refused", str(outcome))
        case JobFailed():
            return Result(job, "failed", str(outcome))
        case _:
            return Result(job, "done", tensors={name: tensor.cpu() for name, tensor in outcome.items()})
