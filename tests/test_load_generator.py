"""The load generator of benchmarks/load.py (mdtriton/testing/load.py), without a server: its statistics, its choice
of model, its arrivals, and that open-loop requests do not wait for answers while closed-loop clients do."""

from __future__ import annotations

import statistics
import threading

import pytest

from mdtriton.testing.load import (LeastBusy, Outcome, Request, mixed_requests, poisson_requests, run_closed_loop,
                                   run_open_loop, summarize)


def test_the_statistics_are_per_size_and_failures_miss_the_deadline():
    outcomes = [Outcome(512, 0.0, 1.0), Outcome(512, 1.0, 4.0), Outcome(512, 2.0, 3.0, error="timed out"),
                Outcome(1024, 0.5, 10.0)]
    summary = summarize(outcomes, {512: 2.0, 1024: 5.0})
    assert summary["wall_s"] == 10.0
    assert summary["images_per_s"] == pytest.approx(3 / 10)
    small = summary["sizes"][512]
    assert (small["requests"], small["failed"]) == (3, 1)
    assert small["mean_s"] == pytest.approx(2.0)  # the answered ones: 1 s and 3 s
    assert small["p50_s"] == pytest.approx(2.0)
    assert small["p99_s"] == pytest.approx(1 + 0.99 * 2)
    assert small["within_deadline"] == pytest.approx(1 / 3)  # 1 s made it; 3 s and the failure did not
    assert summary["sizes"][1024]["within_deadline"] == 0
    assert summary["all"]["within_deadline"] == pytest.approx(1 / 4)
    assert summary["all"]["mean_s"] == pytest.approx((1 + 3 + 9.5) / 3)
    assert summarize(outcomes, None)["all"]["within_deadline"] is None


def test_a_request_goes_to_the_model_with_the_fewest_in_flight():
    models = LeastBusy(["a", "b", "c"])
    with models.model() as first, models.model() as second:
        with models.model() as third:
            assert (first, second, third) == ("a", "b", "c")
        with models.model() as fourth:
            assert fourth == "c"
    with models.model() as again:
        assert again == "a"


def test_arrivals_are_poisson_at_the_rate_and_the_same_for_the_same_seed():
    requests = poisson_requests([512, 1024, 1536], rate=4.0, count=20000, seed=3)
    gaps = [later.arrival_s - earlier.arrival_s for earlier, later in zip(requests, requests[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 4.0, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 4.0, rel=0.05)  # exponential: as wide as its mean
    assert {request.size for request in requests} == {512, 1024, 1536}
    assert requests[:50] == poisson_requests([512, 1024, 1536], 4.0, 50, seed=3)
    assert mixed_requests([512, 1024], 30, seed=1) == mixed_requests([512, 1024], 30, seed=1)


def test_open_loop_requests_are_sent_without_waiting_for_answers():
    # Each answer waits until all three requests are in flight: only a sender that does not wait for answers gets one.
    everyone_sent = threading.Barrier(3, timeout=10)
    requests = [Request(64, number, arrival_s=0.01 * number) for number in range(3)]
    outcomes = run_open_loop(lambda model, request: everyone_sent.wait(), LeastBusy(["m"]), requests)
    assert [outcome.error for outcome in outcomes] == [None, None, None]


def test_closed_loop_clients_keep_at_most_one_request_each_in_flight():
    in_flight, most = 0, 0
    lock = threading.Lock()
    seen = []
    first_two_together = threading.Barrier(2, timeout=10)  # so both clients are surely sending at once

    def send(model: str, request: Request) -> None:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
            seen.append((model, request.seed))
        if request.seed < 2:
            first_two_together.wait()
        threading.Event().wait(0.01)
        with lock:
            in_flight -= 1

    outcomes = run_closed_loop(send, LeastBusy(["a", "b"]), mixed_requests([64, 128], 12, seed=0), clients=2)
    assert most == 2
    assert sorted(seed for _, seed in seen) == list(range(12))  # every request once
    assert sorted(model for model, seed in seen if seed < 2) == ["a", "b"]  # at once: the idle model each time
    assert len(outcomes) == 12 and all(outcome.error is None for outcome in outcomes)
