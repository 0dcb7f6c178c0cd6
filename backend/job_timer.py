"""How each job's wall time splits into communication and compute, measured in the rank's worker process, and how
long the job waited in that worker before it began (for the rank that received the request).

The worker reports each job's split to its stub, which adds it to the rank's Prometheus counters
(backend/metrics.py). The context-parallel attention methods start their transfers without waiting and overlap
them with attention compute (mdtriton.engine.comm.Pending): what counts as communication is the time the job's
stream waits for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

log = logging.getLogger("mdtriton.backend")


class JobTimer:
    """`time_collective` is the Communicator's hook, `job` wraps each job, `waited` is told how long a job this rank
    received waited before it began; on_job(communication_s, compute_s, waited_s, group) runs after each job (waited_s
    is 0 for the jobs of requests other ranks received; group: the ranks of an elastic model's job, "" otherwise)."""

    def __init__(self, device: torch.device, on_job: Callable[[float, float, float, str], None]):
        self.device = device
        self._on_job = on_job
        self._in_job = False  # jobs and their collectives all run in the job runner's thread
        self._host_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._waited = 0.0

    @contextmanager
    def time_collective(self):
        """Measure one collective of a job: host time on CPU (gloo is synchronous), CUDA events on GPU.

        Collectives outside jobs (forming the process groups) are not counted, nor those of a CUDA graph being
        captured (events cannot be recorded into it): a job replayed as a graph counts all its time as compute."""
        if not self._in_job or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            yield
        elif self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            started = time.perf_counter()
            yield
            self._host_seconds += time.perf_counter() - started

    def waited(self, seconds: float) -> None:
        """The job now running was received by this rank and waited `seconds` in its worker before it began (its
        inputs' copy to the device and their check, the job hub's ordering, earlier jobs)."""
        self._waited = seconds

    @contextmanager
    def job(self, elastic_job: str | None = None, group: list[int] | None = None):
        """Time one job and report its split into communication and compute. An elastic model's job (its id) and its
        group are logged with the job's span in wall-clock time, so that the jobs that ran at once on different groups
        can be seen in the log."""
        started = time.perf_counter()
        began = time.time()
        self._in_job = True
        try:
            yield
        except BaseException:
            # A failed job is not reported, and its events may never happen (a collective with a lost peer).
            self._in_job, self._host_seconds, self._events, self._waited = False, 0.0, [], 0.0
            raise
        self._in_job = False
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the job has waited for its work: at once
        wall = time.perf_counter() - started
        communication = self._host_seconds + sum(s.elapsed_time(e) for s, e in self._events) / 1000
        waited, self._host_seconds, self._events, self._waited = self._waited, 0.0, [], 0.0
        if elastic_job is not None:
            log.info("job %s on ranks %s ran from %.3f to %.3f", elastic_job, group, began, time.time())
        self._on_job(communication, max(wall - communication, 0.0), waited, group_label(group) if group else "")


def group_label(group: list[int]) -> str:
    """A group of consecutive ranks as a metric label: "2" for one rank, "0-3" for ranks 0 to 3."""
    return str(group[0]) if len(group) == 1 else f"{group[0]}-{group[-1]}"
