"""Per-rank metrics (backend/metrics.py) on Triton's Prometheus endpoint."""

from __future__ import annotations

import time

import numpy as np

from mdtriton.client.grpc_client import Client
from mdtriton.testing.metrics import scrape_all, steady

FAMILIES = ("mdtriton_requests_received_total", "mdtriton_jobs_total", "mdtriton_communication_seconds_total",
            "mdtriton_compute_seconds_total", "mdtriton_wait_seconds_total")


def flux_ranks(values: dict) -> dict[str, float]:
    return {dict(labels)["rank"]: value for labels, value in values.items() if dict(labels)["model"] == "flux"}


def test_every_rank_counts_every_job_and_splits_its_time(served_models):
    # Settled: jobs of earlier tests (or of the warm-up) may be recorded a moment late.
    reading = steady(lambda: scrape_all(served_models.metrics_url), quiet=0.5)
    before = {name: flux_ranks(reading.get(name, {})) for name in FAMILIES}
    assert all(set(ranks) == {"0", "1"} for ranks in before.values()), before
    rng = np.random.default_rng(0)
    inputs = {"hidden_states": rng.standard_normal((1, 16, 8), dtype=np.float32),
              "encoder_hidden_states": rng.standard_normal((1, 8, 32), dtype=np.float32),
              "pooled_projections": rng.standard_normal((1, 24), dtype=np.float32),
              "timestep": np.full((1,), 0.5, np.float32), "guidance": np.full((1,), 3.5, np.float32),
              "img_ids": np.zeros((16, 3), np.float32), "txt_ids": np.zeros((8, 3), np.float32)}
    with Client(served_models.grpc_address, concurrency=2) as client:
        client.infer_many("flux", [inputs] * 4)
    # The receiving rank answers as soon as its own forward ends; another rank may count its job a moment later.
    deadline = time.monotonic() + 10
    while True:
        reading = scrape_all(served_models.metrics_url)
        after = {name: flux_ranks(reading.get(name, {})) for name in FAMILIES}
        delta = {name: {rank: after[name][rank] - before[name][rank] for rank in ("0", "1")} for name in FAMILIES}
        if delta["mdtriton_jobs_total"] == {"0": 4, "1": 4} or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert delta["mdtriton_jobs_total"] == {"0": 4, "1": 4}  # every rank ran every request
    assert sum(delta["mdtriton_requests_received_total"].values()) == 4  # each was received by one rank
    for rank in ("0", "1"):
        assert delta["mdtriton_communication_seconds_total"][rank] > 0  # input broadcast, ring, all-gather
        assert delta["mdtriton_compute_seconds_total"][rank] > 0
    # Each request waited in the worker of the rank that received it (at least for the job hub's order), and only
    # there: a rank that received none has waited for none.
    for rank in ("0", "1"):
        received = delta["mdtriton_requests_received_total"][rank]
        waited = delta["mdtriton_wait_seconds_total"][rank]
        assert (waited > 0) == (received > 0), (rank, received, waited)
