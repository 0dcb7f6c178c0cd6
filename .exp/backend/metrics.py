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

    def received(self, count: int) -> None:
        self._requests.increment(count)

    def job_done(self, communication_seconds: float, compute_seconds: float, waited_seconds: float) -> None:
        self._jobs.increment(1)
        self._communication.increment(communication_seconds)
        self._compute.increment(compute_seconds)
        self._wait.increment(waited_seconds)
