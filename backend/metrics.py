"""Per-rank counters on Triton's Prometheus endpoint, through the Python backend's metrics API.

Triton's own metrics are per model; these are per rank (labels model, version, rank), so one can see
every rank take part in every job and where its time goes:
  mdtriton_requests_received_total      requests Triton handed to this rank's instance
  mdtriton_jobs_total                   jobs this rank ran with the others (every request, of any
                                        instance, and the warm-up ones)
  mdtriton_communication_seconds_total  time in collectives: the input broadcast and the engine's
                                        AllReduce / AllGather / all-to-all (on GPU: CUDA-event time on
                                        the stream, waiting for the other ranks included)
  mdtriton_compute_seconds_total        the rest of each job's wall time (from the input broadcast until
                                        the outputs are ready)
Context-parallel ring attention overlaps its send/receive with attention compute; only the launch of
those transfers counts as communication.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import triton_python_backend_utils as pb_utils


def _counter(name: str, description: str):
    return pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.COUNTER)


class RankMetrics:
    """This rank's counters; `time_collective` is the Communicator's hook, `job` wraps each job."""

    def __init__(self, model: str, version: str, rank: int, device: torch.device):
        labels = {"model": model, "version": str(version), "rank": str(rank)}
        self.device = device
        # The families are kept as well as their metrics: a family is removed from Triton when its object goes.
        self._families = [
            _counter("mdtriton_requests_received_total", "Requests Triton handed to this rank's instance"),
            _counter("mdtriton_jobs_total", "Jobs this rank ran together with the other ranks"),
            _counter("mdtriton_communication_seconds_total",
                     "Seconds in collectives (input broadcast, AllReduce, AllGather, all-to-all)"),
            _counter("mdtriton_compute_seconds_total", "Seconds of job time outside collectives"),
        ]
        self._requests, self._jobs, self._communication, self._compute = (
            family.Metric(labels=labels) for family in self._families)
        self._in_job = False  # jobs and their collectives all run in the job runner's thread
        self._host_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def received(self, count: int) -> None:
        self._requests.increment(count)

    @contextmanager
    def time_collective(self):
        """Measure one collective of a job: host time on CPU (gloo is synchronous), CUDA events on GPU.

        Collectives outside jobs (forming the process groups) are not counted."""
        if not self._in_job:
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

    @contextmanager
    def job(self):
        """Count one job and split its wall time into communication and compute."""
        started = time.perf_counter()
        self._in_job = True
        try:
            yield
        finally:
            self._in_job = False
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the events must have happened to be read
            wall = time.perf_counter() - started
            communication = self._host_seconds + sum(s.elapsed_time(e) for s, e in self._events) / 1000
            self._host_seconds, self._events = 0.0, []
            self._jobs.increment(1)
            self._communication.increment(communication)
            self._compute.increment(max(wall - communication, 0.0))
