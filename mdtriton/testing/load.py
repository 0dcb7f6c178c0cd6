"""A bounded load generator for served models, and the statistics of what it measured (benchmarks/load.py).

Requests come open-loop (each sent at its Poisson arrival time, whatever the answers: `run_open_loop`) or closed-loop
(a fixed number of clients, each sending its next request when its last one is answered: `run_closed_loop`); a bounded
list of them either way, sizes drawn at random with a seed, so that every layout gets the same sequence. Where several
models serve the same thing, each request goes to the one with the fewest requests in flight (`LeastBusy`), as a
least-connections load balancer sends it. `summarize` gives throughput, latency per size and the share of requests
answered within a deadline.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Request:
    """One image request: its side in pixels (square), its seed, and when it is sent, in seconds after the load
    begins (open loop; 0 for closed-loop clients, which send as soon as they can)."""

    size: int
    seed: int
    arrival_s: float = 0.0


@dataclass(frozen=True)
class Outcome:
    """What became of a request: its size, when it was sent and answered (time.perf_counter()), and the error if it
    failed."""

    size: int
    sent_s: float
    answered_s: float
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.answered_s - self.sent_s


def poisson_requests(sizes: list[int], rate: float, count: int, seed: int) -> list[Request]:
    """count requests arriving as a Poisson process of `rate` per second (exponential gaps), sizes drawn uniformly."""
    generator = random.Random(seed)
    arrival, requests = 0.0, []
    for number in range(count):
        arrival += generator.expovariate(rate)
        requests.append(Request(generator.choice(sizes), number, arrival))
    return requests


def mixed_requests(sizes: list[int], count: int, seed: int) -> list[Request]:
    """count requests for closed-loop clients, sizes drawn uniformly."""
    generator = random.Random(seed)
    return [Request(generator.choice(sizes), number) for number in range(count)]


class LeastBusy:
    """Chooses, for each request, the model with the fewest requests in flight (the first of them on a tie)."""

    def __init__(self, models: list[str]):
        self.in_flight = dict.fromkeys(models, 0)
        self.lock = threading.Lock()

    @contextmanager
    def model(self) -> Iterator[str]:
        """The model to send to, counted as busy with one more request inside the block."""
        with self.lock:
            chosen = min(self.in_flight, key=self.in_flight.get)
            self.in_flight[chosen] += 1
        try:
            yield chosen
        finally:
            with self.lock:
                self.in_flight[chosen] -= 1


Send = Callable[[str, Request], object]  # send(model, request): returns when answered, raises if it failed


def timed(send: Send, models: LeastBusy, request: Request) -> Outcome:
    """Send the request to the least busy model and time it; a failure is an outcome, not an exception."""
    with models.model() as model:
        sent = time.perf_counter()
        try:
            send(model, request)
        except Exception as error:  # noqa: BLE001 - a failed request is counted, the load goes on
            return Outcome(request.size, sent, time.perf_counter(), str(error).strip().splitlines()[-1])
        return Outcome(request.size, sent, time.perf_counter())


def run_open_loop(send: Send, models: LeastBusy, requests: list[Request]) -> list[Outcome]:
    """Send each request at its arrival time, whatever is still in flight (a thread per request in flight, at most
    one per request); the outcomes in the requests' order."""
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        began = time.perf_counter()
        futures = []
        for request in requests:
            time.sleep(max(0.0, began + request.arrival_s - time.perf_counter()))
            futures.append(pool.submit(timed, send, models, request))
        return [future.result() for future in futures]


def run_closed_loop(send: Send, models: LeastBusy, requests: list[Request], clients: int) -> list[Outcome]:
    """`clients` clients send the requests, each its next one when its last one is answered; the outcomes in the
    order they were sent."""
    pending = iter(requests)
    lock = threading.Lock()

    def client() -> list[Outcome]:
        outcomes = []
        while True:
            with lock:
                request = next(pending, None)
            if request is None:
                return outcomes
            outcomes.append(timed(send, models, request))

    with ThreadPoolExecutor(max_workers=clients) as pool:
        futures = [pool.submit(client) for _ in range(clients)]
        return sorted((outcome for future in futures for outcome in future.result()), key=lambda o: o.sent_s)


def latency_statistics(outcomes: list[Outcome], deadline_s: float | None) -> dict:
    """Of some outcomes: how many, how many failed, the answered ones' mean, median and 99th percentile latency
    (seconds; None if none was answered), and the share answered within deadline_s (failures miss it; None without
    a deadline)."""
    answered = [outcome.latency_s for outcome in outcomes if outcome.error is None]
    summary = {"requests": len(outcomes), "failed": len(outcomes) - len(answered),
               "mean_s": statistics.fmean(answered) if answered else None,
               "p50_s": float(np.percentile(answered, 50)) if answered else None,
               "p99_s": float(np.percentile(answered, 99)) if answered else None,
               "within_deadline": None}
    if deadline_s is not None and outcomes:
        summary["within_deadline"] = sum(latency <= deadline_s for latency in answered) / len(outcomes)
    return summary


def summarize(outcomes: list[Outcome], deadlines_s: dict[int, float] | None) -> dict:
    """A load's results: its wall time (first request sent to last answer), throughput (answered images per second of
    it), the statistics of all requests ("all": within each one's own size's deadline) and of each size ("sizes"),
    deadlines_s giving each size's deadline (None: no deadline)."""
    wall_s = max(o.answered_s for o in outcomes) - min(o.sent_s for o in outcomes)
    sizes = sorted({outcome.size for outcome in outcomes})
    by_size = {size: latency_statistics([o for o in outcomes if o.size == size],
                                        deadlines_s[size] if deadlines_s else None) for size in sizes}
    overall = latency_statistics(outcomes, None)
    if deadlines_s:
        overall["within_deadline"] = sum(by_size[size]["within_deadline"] * by_size[size]["requests"]
                                         for size in sizes) / len(outcomes)
    answered = overall["requests"] - overall["failed"]
    return {"wall_s": wall_s, "images_per_s": answered / wall_s if wall_s > 0 else None, "all": overall,
            "sizes": by_size}
