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
  mdtriton_wait_seconds_total           how long the requests this rank received waited in its worker before
                                        their jobs began (their inputs' copy to the device and check, the job
                                        hub's ordering, earlier jobs)
An elastic model (mdtriton build --elastic) also has:
  mdtriton_group_jobs_total             jobs this rank ran on each group of ranks (label group: "0-1" for ranks 0 and 1, "2" for rank 2)
  mdtriton_queued_jobs                  jobs waiting for a group of ranks now (rank 0, where the job hub is)
The rank's worker process measures each job (backend/job_timer.py) and tells its stub, which owns these
counters (only the stub can reach Triton's metrics API).
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils


def _counter(name: str, description: str):
    return pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.COUNTER)


class RankMetrics:
    """This rank's counters: `received` counts requests, `job_done` a job the rank's worker ran and timed."""

    def __init__(self, model: str, version: str, rank: int):
        labels = {"model": model, "version": str(version), "rank": str(rank)}
        # The families are kept as well as their metrics: a family is removed from Triton when its object goes.
        self._families = [
            _counter("mdtriton_requests_received_total", "Requests Triton handed to this rank's instance"),
            _counter("mdtriton_jobs_total", "Jobs this rank ran together with the other ranks"),
            _counter("mdtriton_communication_seconds_total",
                     "Seconds in collectives (input broadcast, AllReduce, AllGather, all-to-all)"),
            _counter("mdtriton_compute_seconds_total", "Seconds of job time outside collectives"),
            _counter("mdtriton_wait_seconds_total",
                     "Seconds the requests this rank received waited in its worker before their jobs began"),
        ]
        self._requests, self._jobs, self._communication, self._compute, self._wait = (
            family.Metric(labels=labels) for family in self._families)
        self._labels = labels
        self._group_family = None  # an elastic model's, made at its first job on a group
        self._group_jobs: dict[str, object] = {}
        self._queue_family = None
        self._queue = None

    def received(self, count: int) -> None:
        self._requests.increment(count)

    def job_done(self, communication_seconds: float, compute_seconds: float, waited_seconds: float,
                 group: str) -> None:
        """Count a job the rank's worker ran and timed; group: the ranks of an elastic model's job ("" otherwise)."""
        if group:
            if self._group_family is None:
                self._group_family = _counter("mdtriton_group_jobs_total",
                                              "Jobs this rank ran on each group of ranks (elastic models)")
            if group not in self._group_jobs:
                self._group_jobs[group] = self._group_family.Metric(labels={**self._labels, "group": group})
            self._group_jobs[group].increment(1)
        self._jobs.increment(1)
        self._communication.increment(communication_seconds)
        self._compute.increment(compute_seconds)
        self._wait.increment(waited_seconds)

    def queue_length(self, waiting: int) -> None:
        """An elastic model's jobs waiting for a group of ranks now (reported by rank 0, where the job hub is)."""
        if self._queue_family is None:
            self._queue_family = pb_utils.MetricFamily(name="mdtriton_queued_jobs",
                                                       description="Jobs waiting for a group of ranks (elastic models)",
                                                       kind=pb_utils.MetricFamily.GAUGE)
            self._queue = self._queue_family.Metric(labels=self._labels)
        self._queue.set(waiting)
