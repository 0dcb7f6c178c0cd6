"""Clients that keep sending requests to a served tiny_transformer and record every outcome, checked against
the single-process reference (shared by the fault, reload and load tests)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.engine_builder import random_weights, reference_module

CONFIG = {"hidden_size": 64, "num_heads": 4, "mlp_ratio": 4, "num_layers": 2}


@dataclass
class Outcome:
    start: float  # time.monotonic()
    end: float
    status: str | None  # None: an answer; else the gRPC status, e.g. "StatusCode.UNAVAILABLE"
    message: str = ""
    right: bool | None = None  # for answers: equal to the reference

    @property
    def latency(self) -> float:
        return self.end - self.start


class Reference:
    """Inputs and the outputs the model must give for them, from the same seeded weights on one process."""

    def __init__(self, seed: int, count: int = 8, config: dict = CONFIG):
        self.module = reference_module("tiny_transformer", config, random_weights("tiny_transformer", config, seed),
                                       "FP32")
        generator = torch.Generator().manual_seed(1000 + seed)
        self.inputs = [torch.randn(1 + i % 2, 3 + i % 7, config["hidden_size"], generator=generator).numpy()
                       for i in range(count)]
        self.outputs = [self.expected(x) for x in self.inputs]

    def expected(self, array: np.ndarray) -> np.ndarray:
        """The model's output for any input."""
        with torch.inference_mode():
            return self.module(torch.from_numpy(array))["output"].numpy()

    def is_right(self, index: int, output: np.ndarray) -> bool:
        expected = self.outputs[index % len(self.outputs)]
        return output.shape == expected.shape and float(np.abs(output - expected).max()) < 1e-4


def large_input() -> np.ndarray:
    """An input whose job needs far more than 16 MiB of new memory on each rank (to make one run out of memory)."""
    return np.random.default_rng(0).standard_normal((8, 2048, CONFIG["hidden_size"]), dtype=np.float32)


def send(client: grpcclient.InferenceServerClient, model: str, array: np.ndarray, version: str = "",
         timeout: float = 120.0) -> tuple[Outcome, np.ndarray | None]:
    """One request; its outcome and output (None on an error), never an exception."""
    tensor = grpcclient.InferInput("hidden_states", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    start = time.monotonic()
    try:
        result = client.infer(model, [tensor], model_version=version, client_timeout=timeout)
    except InferenceServerException as error:
        return Outcome(start, time.monotonic(), str(error.status()), error.message() or ""), None
    return Outcome(start, time.monotonic(), None), result.as_numpy("output")


def ask(client: grpcclient.InferenceServerClient, model: str, reference: Reference, index: int,
        version: str = "") -> Outcome:
    """One request with reference input `index`, its answer checked against the reference."""
    outcome, output = send(client, model, reference.inputs[index % len(reference.inputs)], version)
    if output is not None:
        outcome.right = reference.is_right(index, output)
    return outcome


class Clients:
    """`count` threads, each with its own gRPC connection, sending requests back to back until stop()."""

    def __init__(self, address: str, model: str, reference: Reference, count: int, version: str = ""):
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(address, model, reference, version, k), daemon=True)
                         for k in range(count)]

    def start(self) -> "Clients":
        for thread in self._threads:
            thread.start()
        return self

    def _loop(self, address: str, model: str, reference: Reference, version: str, offset: int) -> None:
        client = grpcclient.InferenceServerClient(address)
        index = offset
        while not self._stopping.is_set():
            outcome = ask(client, model, reference, index, version)
            with self._lock:
                self.outcomes.append(outcome)
            index += 1
        client.close()

    def stop(self, timeout: float = 150.0) -> list[Outcome]:
        """Stop sending and wait for every request in flight to end; all outcomes, in completion order."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in self._threads), "a request never ended"
        return self.outcomes
