"""What a rank's worker needs to know, from its stub: what both ends read, apart from either."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to know, from its stub."""

    engine_dir: str
    rank: int
    device: str  # "cpu" or "cuda:N"
    rendezvous_dir: str  # the area of this model version in this server (the stub knows the server's pid)
    request_timeout: float  # the longest a collective waits for its peers (each job brings its own deadline)
    adapters_dir: str  # where a pipeline's LoRA adapters are kept (mdtriton.lora)
    lora_cache_mib: int  # how much of them the rank keeps loaded
    join_timeout: float
    threads: int | None  # torch threads on CPU; None: torch's default (OMP_NUM_THREADS is set)
    elastic_min_speedup: float  # what a larger group must gain for a lone job of an elastic model (job_scheduler)

    def to_json(self) -> str:
        return json.dumps(asdict(self))
