"""A rank's worker: the process that owns the rank's device, engine and communicator, for one epoch.

Each Triton instance (a stub process) starts one worker for its rank (backend/worker_keeper.py) and passes it
requests and answers through shared memory (backend/tensor_transfer.py), so that an engine crash, a segfault in
a kernel, an out-of-memory kill or a CUDA error kills a worker, never a stub or the Triton server.

A worker enters the rendezvous, loads its shard, forms the group with the other ranks' workers and runs jobs
(backend/job_runner.py) until that epoch ends, for whatever reason; then it tells its stub why and exits.
Its stub starts a new one (healing), which loads again (from the page cache) and meets the others' new workers.

Run by the stub as `python -m mdtriton.backend.rank_worker SPEC_JSON LINK_FD`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from mdtriton.backend.job_runner import JobRunner
from mdtriton.backend.job_timer import JobTimer
from mdtriton.backend.messages import (Cancel, Done, Ended, Failed, GivenUp, JobTimed, Loaded, Progress,
                                       ProtocolError, QueueLength, RanksUnavailable, Refused, RunRequest, Serving,
                                       Started, Stop, Stopped, receive, send)
from mdtriton.backend.process_state import end_with_parent
from mdtriton.backend.rendezvous import Epoch, Rendezvous
from mdtriton.backend.tensor_transfer import TensorLink
from mdtriton.backend.worker_spec import WorkerSpec
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import Engine
from mdtriton.engine.job_control import JobFailed, JobStopped
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.request_check import RequestError
from mdtriton.serving import load_engine
from mdtriton.lora.directory import AdapterSettings

log = logging.getLogger("mdtriton.backend")

def warn_of_a_foreign_cudnn(rank: int) -> None:
    """Log a warning if torch cannot use the cuDNN it was built with: another one found first (a directory on
    LD_LIBRARY_PATH is searched before torch's own libraries) leaves torch running without cuDNN's attention, slower
    and with no error (Qwen-Image's served image 1.16x diffusers' time on one H200, docs/benchmarks.md)."""
    try:
        torch.backends.cudnn.version()
    except RuntimeError as error:
        log.warning("rank %d: %s (LD_LIBRARY_PATH=%s): attention runs slower kernels until that directory leaves the "
                    "path", rank, error, os.environ.get("LD_LIBRARY_PATH", ""))


class RankWorker:
    def __init__(self, spec: WorkerSpec, link: TensorLink):
        self.spec = spec
        self.link = link
        self.device = torch.device(spec.device)

    def run(self) -> None:
        """Load, serve one epoch, and tell the stub how it ended."""
        spec = self.spec
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            warn_of_a_foreign_cudnn(spec.rank)
        elif spec.threads is not None:
            torch.set_num_threads(spec.threads)
        manifest = Manifest.read(Path(spec.engine_dir))
        rendezvous = Rendezvous(Path(spec.rendezvous_dir), spec.rank, manifest.plan.world_size)
        entered = rendezvous.enter()
        try:
            comm = Communicator(manifest.plan, spec.rank, self.device)
            engine = self._load(manifest, comm)
        except Exception as error:  # noqa: BLE001 - any load failure: tell the other ranks, then the stub
            message = f"{type(error).__name__}: {error}"
            rendezvous.fail(entered, message)  # waits until the other ranks have seen it
            send(self.link, GivenUp(f"rank {spec.rank} could not load: {message}"))
            return
        send(self.link, Loaded())
        timer = JobTimer(self.device, self._report_job_time)
        comm.collective_timer = timer.time_collective
        runner = JobRunner(engine, comm, rendezvous, entered, spec.join_timeout, spec.request_timeout, timer,
                           on_serving=self._report_serving, on_started=self._report_started,
                           on_progress=self._report_progress, on_queue_length=self._report_queue_length,
                           min_speedup=spec.elastic_min_speedup)
        runner.start()
        threading.Thread(target=self._take_jobs, args=(runner,), name="mdtriton-stub-link", daemon=True).start()
        end = runner.wait_ended()
        send(self.link, (GivenUp if end.given_up else Ended)(end.reason, end.unloading))

    def _load(self, manifest: Manifest, comm: Communicator) -> Engine:
        start = time.perf_counter()
        engine = load_engine(Path(self.spec.engine_dir), manifest, comm,
                             AdapterSettings(Path(self.spec.adapters_dir), self.spec.lora_cache_mib))
        # benchmarks/serving.py reads this line to split a healing's time.
        log.info("rank %d/%d (worker pid %d) loaded %s on %s in %.2f s (%.2f s of it warming up)", comm.rank,
                 manifest.plan.world_size, os.getpid(), self.spec.engine_dir, self.device, time.perf_counter() - start,
                 engine.warm_up_seconds)
        return engine

    def _take_jobs(self, runner: JobRunner) -> None:
        """Submit the stub's jobs to the runner; stop the runner when the stub says so, or is gone."""
        while True:
            try:
                message = receive(self.link)
            except (EOFError, OSError):
                message = Stop()
            except ProtocolError as error:
                log.error("rank %d: %s: leaving", self.spec.rank, error)
                message = Stop()
            match message:
                case Stop():
                    runner.stop()
                    return
                case RunRequest(id=job_id, deadline=deadline, tensors=inputs):
                    try:
                        job = runner.submit(inputs, job_id, deadline)
                    except RanksUnavailable:
                        continue  # the epoch is ending: the stub sends the job again to the next worker
                    job.result.add_done_callback(partial(self._answer, job_id))
                case Cancel(id=job_id, reason=reason):
                    runner.cancel(job_id, reason)
                case _:
                    log.error("rank %d: a worker takes jobs and stops, not %s: leaving", self.spec.rank, message)
                    runner.stop()
                    return

    def _answer(self, job_id: str, result) -> None:
        """Send the stub a job's outputs, or how every rank ended it early (the request's fault, another failure before
        its collectives, or a stop its stub asked for)."""
        match result.exception():
            case None:
                send(self.link, Done(job_id, result.result()))
            case RequestError() as error:
                send(self.link, Refused(job_id, str(error)))
            case JobFailed(request_error=True) as error:
                send(self.link, Refused(job_id, str(error)))
            case JobFailed() as error:
                send(self.link, Failed(job_id, str(error)))
            case JobStopped(done=done, total=total):
                send(self.link, Stopped(job_id, done, total))
            case RanksUnavailable():
                pass  # it failed with its epoch: the stub hands it to the next worker

    def _report_serving(self, epoch: Epoch) -> None:
        send(self.link, Serving(epoch.number, dict(epoch.members)))

    def _report_started(self, job_id: str) -> None:
        send(self.link, Started(job_id))

    def _report_progress(self, job_id: str, done: int, total: int) -> None:
        send(self.link, Progress(job_id, done, total))

    def _report_job_time(self, communication: float, compute: float, waited: float, group: str) -> None:
        send(self.link, JobTimed(communication, compute, waited, group))

    def _report_queue_length(self, waiting: int) -> None:
        send(self.link, QueueLength(waiting))


def main(argv: list[str]) -> None:
    spec = WorkerSpec(**json.loads(argv[1]))
    # On a GPU the regions are page-locked: the inputs' copies to the GPU, and the outputs' back, read and write them.
    link = TensorLink(Connection(int(argv[2])), pinned=spec.device.startswith("cuda"))
    end_with_parent(int(argv[3]), signal.SIGKILL)  # no worker outlives its stub
    logging.basicConfig(level=logging.INFO, format=f"mdtriton rank {spec.rank} worker: %(message)s")
    try:
        RankWorker(spec, link).run()
    finally:
        link.close()
    # Skip interpreter teardown: torch.distributed's and gloo's destructors may block on peers that are gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
