"""64 concurrent clients against a 2-rank model on a real tritonserver: zero wrong answers, zero errors, latency
percentiles reported, memory (server, stubs, rank workers) flat. CI runs it for MDTRITON_LOAD_SECONDS (default 20 s); the
figures in docs/reliability.md come from MDTRITON_LOAD_SECONDS=120."""

from __future__ import annotations

import os
import statistics
import threading
import time

import pytest

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.engine.plan import ParallelPlan
from tests.backend.load_clients import CONFIG, Clients, Reference
from mdtriton.testing.triton_processes import rank_workers, rss_bytes, stub_processes, wait_for_stubs

CLIENTS = 64
SECONDS = float(os.environ.get("MDTRITON_LOAD_SECONDS", "20"))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(fraction * len(ordered)), len(ordered) - 1)]


def most_in_flight(outcomes) -> int:
    """The largest number of requests that were in flight at one time."""
    events = sorted([(o.start, 1) for o in outcomes] + [(o.end, -1) for o in outcomes])
    in_flight = most = 0
    for _, change in events:
        in_flight += change
        most = max(most, in_flight)
    return most


@pytest.mark.timeout(SECONDS + 240)
def test_64_clients_get_only_right_answers_and_memory_stays_flat(tmp_path, server_factory):
    build_model_version(tmp_path / "repo", "tiny", BuildRequest(
        "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=9, progress=False))
    server = server_factory(tmp_path / "repo")
    stubs = wait_for_stubs(server.process.pid, 2)
    workers = rank_workers(server.process.pid)
    processes = [server.process.pid, *stubs.values(), *(pid for pids in workers.values() for pid in pids)]
    assert len(processes) == 5, workers
    samples: list[tuple[float, int]] = []
    sampling = threading.Event()

    def sample_memory():
        while not sampling.wait(1.0):
            samples.append((time.monotonic(), rss_bytes(processes)))

    sampler = threading.Thread(target=sample_memory, daemon=True)
    sampler.start()
    started = time.monotonic()
    clients = Clients(server.grpc_address, "tiny", Reference(9, count=16), count=CLIENTS).start()
    time.sleep(SECONDS)
    outcomes = clients.stop()
    elapsed = time.monotonic() - started
    sampling.set()
    sampler.join()

    errors = [o for o in outcomes if o.status is not None]
    wrong = [o for o in outcomes if o.status is None and not o.right]
    latencies = [o.latency * 1000 for o in outcomes]
    # Memory after a warm-up quarter: the last quarter's mean against the second quarter's.
    warm = [rss for at, rss in samples if at > started + SECONDS / 4]
    quarter = max(len(warm) // 3, 1)
    early, late = statistics.mean(warm[:quarter]), statistics.mean(warm[-quarter:])
    print(f"\n{CLIENTS} clients, {elapsed:.0f} s: {len(outcomes)} requests ({len(outcomes) / elapsed:.0f}/s, "
          f"at most {most_in_flight(outcomes)} in flight), "
          f"{len(errors)} errors, {len(wrong)} wrong; latency ms p50 {percentile(latencies, 0.5):.0f} "
          f"p90 {percentile(latencies, 0.9):.0f} p99 {percentile(latencies, 0.99):.0f} max {max(latencies):.0f}; "
          f"RSS server+stubs+workers {early / 2**20:.0f} -> {late / 2**20:.0f} MiB")
    assert not errors, errors[:3]
    assert not wrong, wrong[:3]
    assert len(outcomes) >= 2 * CLIENTS and most_in_flight(outcomes) >= CLIENTS // 2, "the load was not concurrent"
    assert late - early < max(0.05 * early, 30 * 2**20), f"memory grew from {early / 2**20:.0f} to {late / 2**20:.0f} MiB"
    assert stub_processes(server.process.pid) == stubs  # no stub lost
    assert rank_workers(server.process.pid) == workers  # and no worker restarted: the load alone never heals
