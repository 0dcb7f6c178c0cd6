"""Every rank runs every job, in one order: the data plane of the backend.

A JobRunner lives in each rank's stub process. Its thread joins the rendezvous, forms the process
group (NCCL on GPU, gloo on CPU), connects to rank 0's job hub, and then runs the jobs the hub
orders: the rank that received the request broadcasts its inputs, every rank runs the engine, and
the receiving rank hands the outputs back to its waiting request.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from mdtriton.backend.job_hub import HubLink, JobHub
from mdtriton.backend.rendezvous import Generation, Rendezvous
from mdtriton.engine.dtypes import TORCH_DTYPES, TRITON_TYPES
from mdtriton.engine.engine import Engine

log = logging.getLogger("mdtriton.backend")


class RanksUnavailable(Exception):
    """The ranks are not (or no longer) together, so no job can run now."""


@dataclass
class Job:
    inputs: dict[str, torch.Tensor]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    result: Future = field(default_factory=Future)


class JobRunner:
    def __init__(self, engine: Engine, rendezvous: Rendezvous, join_timeout: float, collective_timeout: float,
                 metrics):
        self.engine = engine
        self.comm = engine.comm
        self.rendezvous = rendezvous
        self.join_timeout = join_timeout
        self.collective_timeout = collective_timeout
        self.metrics = metrics  # backend.metrics.RankMetrics: its job() context counts and times each job
        self._pending: dict[str, Job] = {}
        self._pending_lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._failure: str | None = None
        self._generation: Generation | None = None
        self._link: HubLink | None = None
        self._thread = threading.Thread(target=self._run, name="mdtriton-job-runner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every rank has joined; False if that did not happen within timeout."""
        return self._ready.wait(timeout)

    def submit(self, inputs: dict[str, torch.Tensor], timeout: float) -> Job:
        """Queue a job for all ranks; its `result` future gets the outputs (or the error)."""
        if not self._ready.wait(timeout):
            raise RanksUnavailable(self._failure or f"not all {self.comm.plan.world_size} ranks have joined "
                                   f"within {timeout:.0f} s; check the server log of the other instances")
        job = Job(inputs)
        with self._pending_lock:
            self._pending[job.id] = job
        header = [[name, TRITON_TYPES[t.dtype], list(t.shape)] for name, t in inputs.items()]
        try:
            self._link.send({"type": "submit", "job": job.id, "origin": self.comm.rank, "inputs": header})
        except OSError as error:
            self._fail_pending(f"lost the connection to rank 0's job hub: {error}")
        return job

    def _run(self) -> None:
        if self.comm.device.type == "cuda":
            torch.cuda.set_device(self.comm.device)
        try:
            self._connect()
        except Exception as error:  # noqa: BLE001 - reported to every request instead of killing the thread
            self._failure = f"rank {self.comm.rank} could not join the other ranks: {error}"
            log.error(self._failure)
            return
        self._serve()

    def _connect(self) -> None:
        plan, rank = self.comm.plan, self.comm.rank
        self._generation = generation = self.rendezvous.join(self.join_timeout, self._stopping)
        if plan.world_size > 1:
            backend = "nccl" if self.comm.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.FileStore(str(generation.store_path), plan.world_size),
                                    rank=rank, world_size=plan.world_size,
                                    timeout=timedelta(seconds=self.collective_timeout),
                                    device_id=self.comm.device if backend == "nccl" else None)
            self.comm.join_groups()
        if rank == 0:
            JobHub(generation.hub_address, generation.token, plan.world_size).start()
        self._link = HubLink(generation.hub_address, generation.token, rank, self.join_timeout)
        self._ready.set()
        log.info("rank %d joined generation %d of %s", rank, generation.number, plan)

    def _serve(self) -> None:
        while True:
            try:
                message = self._link.receive()
            except Exception:  # noqa: BLE001 - EOF, reset, or our own close() during stop()
                if self._stopping.is_set():
                    return
                message = {"type": "stop", "reason": "rank 0's job hub went away (rank 0 exited or was restarted)"}
            if message["type"] == "stop":
                self._ready.clear()
                self._failure = message["reason"]
                self._fail_pending(message["reason"])
                return
            with self.metrics.job():
                self._execute(message)

    def _execute(self, message: dict) -> None:
        origin = message["origin"]
        mine = origin == self.comm.rank
        job = self._pop(message["job"]) if mine else None
        inputs = {}
        for name, data_type, shape in message["inputs"]:
            if mine:
                tensor = job.inputs[name].to(self.comm.device).contiguous()
            else:
                tensor = torch.empty(shape, dtype=TORCH_DTYPES[data_type], device=self.comm.device)
            inputs[name] = self.comm.broadcast(tensor, src=origin)
        try:
            outputs = self.engine.forward(inputs)
            if self.comm.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        except Exception as error:  # noqa: BLE001 - the error belongs to the request, not to this thread
            if mine:
                job.result.set_exception(error)
            return
        if mine:
            job.result.set_result(outputs)

    def _pop(self, job_id: str) -> Job:
        with self._pending_lock:
            return self._pending.pop(job_id)

    def _fail_pending(self, reason: str) -> None:
        with self._pending_lock:
            jobs, self._pending = list(self._pending.values()), {}
        for job in jobs:
            job.result.set_exception(RanksUnavailable(reason))

    def stop(self) -> None:
        """Leave: tell the hub (so the other ranks stop without waiting on us), then free the rendezvous slot."""
        self._stopping.set()
        if self._link is not None:
            try:
                self._link.send({"type": "leave"})
            except OSError:
                pass
            self._link.close()
        # The process group is not destroyed here: Triton ends the stub process right after finalize,
        # which frees it, while destroying an NCCL group whose peers are already gone can block.
        if self._generation is not None:
            self.rendezvous.leave(self._generation.number)
