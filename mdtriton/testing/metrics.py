"""Reading mdtriton's per-rank metrics (backend/metrics.py) from Triton's Prometheus endpoint: for tests and
benchmarks."""

from __future__ import annotations

import re
import time
import urllib.request

SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


def scrape_all(metrics_url: str) -> dict[str, dict[tuple, float]]:
    """Every metric family of one reading of the endpoint: name -> {(("model", m), ("rank", r), ...): value}."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    families = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = tuple(sorted(tuple(pair.split("=", 1)) for pair in match.group(2).split(",")))
            samples = families.setdefault(match.group(1), {})
            samples[tuple((key, value.strip('"')) for key, value in labels)] = float(match.group(3))
    return families


def scrape(metrics_url: str, name: str) -> dict[tuple, float]:
    """{(("model", m), ("rank", r), ("version", v)): value} of one metric family."""
    return scrape_all(metrics_url).get(name, {})


def settled(metrics_url: str, name: str, quiet: float = 0.5) -> dict[tuple, float]:
    """scrape(), once two scrapes `quiet` seconds apart agree: a stub records its worker's job times once the worker
    has been quiet for 0.2 s (or when its next job starts), so the jobs just answered may not be counted yet."""
    return steady(lambda: scrape(metrics_url, name), quiet)


def steady(read, quiet: float):
    """read(), once two readings `quiet` seconds apart agree."""
    values = read()
    while True:
        time.sleep(quiet)
        again = read()
        if again == values:
            return values
        values = again


# What rank_counters reads: its name for each, and the metric families (backend/metrics.py) it sums.
RANK_COUNTERS = {"job": ("mdtriton_compute_seconds_total", "mdtriton_communication_seconds_total"),
                 "received": ("mdtriton_requests_received_total",), "waited": ("mdtriton_wait_seconds_total",)}


def rank_counters(metrics_url: str, quiet: float = 0.5) -> dict[str, dict[str, float]]:
    """By rank, as the stubs count them on Triton's metrics endpoint (one model served), once two readings `quiet`
    seconds apart agree (a stub records its jobs' times a moment after answering): "job", its seconds of jobs so far
    (compute and collectives: from the input broadcast until the outputs are ready); "received", the requests Triton
    handed its instance; "waited", the seconds those requests waited in its worker before their jobs began (the hub's
    order included)."""
    def read() -> dict[str, dict[str, float]]:
        reading = scrape_all(metrics_url)
        counters: dict[str, dict[str, float]] = {}
        for kind, names in RANK_COUNTERS.items():
            counters[kind] = {}
            for name in names:
                for labels, value in reading.get(name, {}).items():
                    rank = dict(labels)["rank"]
                    counters[kind][rank] = counters[kind].get(rank, 0.0) + value
        return counters

    return steady(read, quiet)


def job_seconds(metrics_url: str, quiet: float = 0.5) -> float:
    """The seconds of jobs run so far by every rank of every model served, summed (rank_counters' "job": compute and
    collectives), once two readings `quiet` seconds apart agree: the GPUs' busy time, for a server that holds several
    models."""
    def read() -> float:
        reading = scrape_all(metrics_url)
        return sum(value for name in RANK_COUNTERS["job"] for value in reading.get(name, {}).values())

    return steady(read, quiet)
