"""A real tritonserver serving a 2-rank CPU engine (gloo), queried over gRPC through our client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.client.grpc_client import Client, ClientError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.testing.triton_processes import rank_workers
from tests.conftest import start_server

CONFIG = {"hidden_size": 64, "num_heads": 4, "mlp_ratio": 4, "num_layers": 2}
MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    build_model_version(repository, MODEL, BuildRequest(
        "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=3, progress=False))
    server = start_server(repository, repository.parent / "server.log")
    yield server
    server.stop()


def reference(hidden_states: torch.Tensor) -> torch.Tensor:
    module = reference_module("tiny_transformer", CONFIG, random_weights("tiny_transformer", CONFIG, 3), "FP32")
    with torch.inference_mode():
        return module(hidden_states)["output"]


def random_input(seed: int, seq: int = 9) -> torch.Tensor:
    return torch.randn(2, seq, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(seed))


def test_two_ranks_match_single_process_reference(served):
    hidden_states = random_input(0)
    with Client(served.grpc_address) as client:
        output = client.infer(MODEL, {"hidden_states": hidden_states})["output"]
    assert output.shape == (2, 9, 64)
    assert np.abs(output - reference(hidden_states).numpy()).max() < 1e-5


def test_the_rank_worker_reads_the_inputs_where_triton_put_them(served):
    """The stub does not copy a request's inputs for its worker: it lends their place in the shared memory file
    where Triton's Python backend keeps them, which the worker then maps (backend/tensor_transfer.py)."""
    hidden_states = random_input(5)
    with Client(served.grpc_address) as client:
        for _ in range(4):  # Triton's scheduler picks the instance: give both ranks requests
            output = client.infer(MODEL, {"hidden_states": hidden_states})["output"]
    assert np.abs(output - reference(hidden_states).numpy()).max() < 1e-5
    workers = [pid for pids in rank_workers(served.process.pid).values() for pid in pids]
    assert len(workers) == 2
    lent = [pid for pid in workers if "/dev/shm/triton_python_backend_shm_region_" in Path(f"/proc/{pid}/maps").read_text()]
    assert lent, "no rank worker maps Triton's shared memory: the stub copied the inputs"


def test_numpy_2_in_the_server_environment(served):
    # The stubs import this environment's site-packages (server_environment), so this is their numpy:
    # numpy 2 broke as_numpy()/numpy-backed outputs silently; the DLPack path must give right answers.
    assert int(np.__version__.split(".")[0]) >= 2
    hidden_states = random_input(5)
    with Client(served.grpc_address) as client:
        output = client.infer(MODEL, {"hidden_states": hidden_states})["output"]
    assert np.abs(output).max() > 0.1  # not the zeros numpy 2 conversions returned
    assert np.abs(output - reference(hidden_states).numpy()).max() < 1e-5


@pytest.mark.timeout(180)
def test_concurrent_requests_all_right(served):
    """48 requests from 16 threads land on both instances; every rank runs every one, in one order."""
    inputs = [random_input(100 + i, seq=3 + i % 7) for i in range(48)]
    expected = [reference(x).numpy() for x in inputs]

    def ask(i):
        with Client(served.grpc_address, timeout=120) as client:
            return client.infer(MODEL, {"hidden_states": inputs[i]})["output"]

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(ask, range(48)))
    errors = [np.abs(o - e).max() for o, e in zip(outputs, expected)]
    assert max(errors) < 1e-5
    stats = grpcclient.InferenceServerClient(served.grpc_address).get_inference_statistics(MODEL, as_json=True)
    assert int(stats["model_stats"][0]["inference_count"]) >= 48


def raw_infer(served, name: str, array: np.ndarray, datatype: str):
    client = grpcclient.InferenceServerClient(served.grpc_address)
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return client.infer(MODEL, [tensor])


@pytest.mark.parametrize("name, array, datatype, message", [
    ("hidden_states", np.zeros((2, 4, 32), np.float32), "FP32", "unexpected shape"),
    ("hidden_states", np.zeros((2, 4), np.float32), "FP32", "unexpected shape"),
    ("hidden_states", np.zeros((2, 4, 64), np.int64), "INT64", "data-type"),
    ("hidden_states", np.zeros((2, 0, 64), np.float32), "FP32", "empty"),
    ("wrong_name", np.zeros((2, 4, 64), np.float32), "FP32", "unexpected inference input"),
])
def test_bad_input_is_invalid_arg_and_server_keeps_serving(served, name, array, datatype, message):
    with pytest.raises(InferenceServerException) as caught:
        raw_infer(served, name, array, datatype)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert message in caught.value.message()
    hidden_states = random_input(7)
    with Client(served.grpc_address) as client:
        output = client.infer(MODEL, {"hidden_states": hidden_states})["output"]
    assert np.abs(output - reference(hidden_states).numpy()).max() < 1e-5


def test_missing_input_is_invalid_arg(served):
    client = grpcclient.InferenceServerClient(served.grpc_address)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, [])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "hidden_states" in caught.value.message()


def test_client_reports_server_errors_in_one_line(served):
    with Client(served.grpc_address) as client, pytest.raises(ClientError) as caught:
        client.infer("no_such_model", {"hidden_states": random_input(0)})
    assert "no_such_model" in str(caught.value) and "\n" not in str(caught.value)
