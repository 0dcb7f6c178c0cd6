"""The answer to a request is the same, bit for bit, whichever instance (rank) Triton hands it to: tensor-parallel
(tp 2) and context-parallel ring (cp 2) engines on CPU ranks."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mdtriton.client.grpc_client import Client
from mdtriton.families.flux.transformer import TINY_CONFIG as FLUX_CONFIG
from mdtriton.testing.metrics import scrape
from tests.engine.flux_cases import flux_inputs
from tests.served_models import TINY_CONFIG

REQUESTS = 24


def received_per_rank(metrics_url: str, model: str) -> dict[str, float]:
    values = scrape(metrics_url, "mdtriton_requests_received_total")
    return {dict(labels)["rank"]: value for labels, value in values.items()
            if dict(labels)["model"] == model and dict(labels)["version"] == "1"}


def tiny_input() -> dict[str, np.ndarray]:
    return {"hidden_states": torch.randn(2, 11, TINY_CONFIG["hidden_size"],
                                         generator=torch.Generator().manual_seed(21)).numpy()}


def flux_input() -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in flux_inputs(FLUX_CONFIG, text_len=7, image_len=13, batch=2, seed=4).items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, inputs", [("tiny", tiny_input), ("flux", flux_input)], ids=["tp2", "ring_cp2"])
def test_the_same_request_gets_the_same_bits_from_every_rank(served_models, model, inputs):
    before = received_per_rank(served_models.metrics_url, model)
    request = inputs()
    outputs = []
    deadline = time.monotonic() + 120
    # Triton spreads concurrent requests over both instances; go on until each has received some.
    while True:
        with Client(served_models.grpc_address, concurrency=4) as client:
            outputs += [answer["output" if model == "tiny" else "sample"]
                        for answer in client.infer_many(model, [request] * REQUESTS, version="1")]
        after = received_per_rank(served_models.metrics_url, model)
        if all(after[rank] > before[rank] for rank in ("0", "1")) or time.monotonic() > deadline:
            break
    assert all(after[rank] > before[rank] for rank in ("0", "1")), (before, after)
    differing = [i for i, output in enumerate(outputs) if output.tobytes() != outputs[0].tobytes()]
    largest = max((float(np.abs(outputs[i] - outputs[0]).max()) for i in differing), default=0.0)
    assert not differing, f"{len(differing)} of {len(outputs)} answers differ from the first, by up to {largest:.3g}"
