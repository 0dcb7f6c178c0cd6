"""The Python client against a real server: versions, tensor kinds, shared memory, concurrency, errors."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from mdtriton.client.grpc_client import Client, ClientError, is_local
from mdtriton.client.shared_memory import region_size
from mdtriton.client.server_key import key_headers
from tests.served_models import tiny_reference


def random_input(seed: int, shape=(2, 9, 64)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def our_shm_files() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("mdtriton_*"))


def registered_regions(served) -> dict:
    status = grpcclient.InferenceServerClient(served.grpc_address).get_system_shared_memory_status(
        headers=key_headers(served.grpc_address), as_json=True)
    return status.get("regions", {})


def test_each_version_answers_with_its_own_engine(served_models):
    x = random_input(0)
    with Client(served_models.grpc_address) as client:
        assert client.metadata("tiny")["versions"] == ["1", "2"]
        answers = {version: client.infer("tiny", {"hidden_states": x}, version=version)["output"]
                   for version in ("1", "2")}
    for version, answer in answers.items():
        assert np.abs(answer - tiny_reference(version, torch.from_numpy(x)).numpy()).max() < 1e-5
    assert np.abs(answers["1"] - answers["2"]).max() > 0.1  # really two different engines


def test_torch_tensors_and_lists_are_accepted(served_models):
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with Client(served_models.grpc_address) as client:
        from_torch = client.infer("tiny", {"hidden_states": x}, version="1")["output"]
        from_list = client.infer("tiny", {"hidden_states": x.tolist()}, version="1")["output"]
    assert from_torch.dtype == np.float32  # converted to the declared FP32
    np.testing.assert_array_equal(from_torch, from_list)
    assert np.abs(from_torch - tiny_reference("1", x.float()).numpy()).max() < 1e-5


def test_shared_memory_gives_the_same_answers_and_leaves_nothing(served_models):
    """Every tensor through system shared memory (threshold 0) vs every tensor in the gRPC messages."""
    inputs = [random_input(10 + i, (1, 3 + i % 4, 64)) for i in range(12)]
    before = our_shm_files()
    with Client(served_models.grpc_address, shm_threshold=None) as plain:
        expected = [plain.infer("tiny", {"hidden_states": x}, version="2")["output"] for x in inputs]
    with Client(served_models.grpc_address, shm_threshold=0, concurrency=4) as shm:
        assert shm.shm_threshold == 0  # 127.0.0.1 is local: shared memory is on
        first = [shm.infer("tiny", {"hidden_states": x}, version="2") for x in inputs]
        concurrent = shm.infer_many("tiny", [{"hidden_states": x} for x in inputs], version="2")
        registered = registered_regions(served_models)
        assert registered and all(name.startswith("mdtriton_") for name in registered)
        assert our_shm_files()  # the regions exist while the client is open...
    for got in (first, concurrent):
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a["output"], b)
    # ... and are unregistered from the server and unlinked from /dev/shm when it closes.
    assert registered_regions(served_models) == {}
    assert our_shm_files() == before


def test_outputs_go_through_shared_memory_once_their_size_is_known(served_models):
    x = random_input(3, (1, 64, 64))  # 16 KiB in, 16 KiB out
    with Client(served_models.grpc_address, shm_threshold=8 << 10) as client:
        first = client.infer("tiny", {"hidden_states": x}, version="1")["output"]
        regions_after_first = len(registered_regions(served_models))
        second = client.infer("tiny", {"hidden_states": x}, version="1")["output"]
        regions_after_second = len(registered_regions(served_models))
    assert (regions_after_first, regions_after_second) == (1, 2)  # the input's, then the output's too
    np.testing.assert_array_equal(first, second)


def test_region_sizes_grow_in_powers_of_two():
    assert region_size(1) == 1 << 16 and region_size(1 << 16) == 1 << 16 and region_size((1 << 20) + 1) == 1 << 21


def test_only_loopback_addresses_count_as_local():
    assert is_local("127.0.0.1:8001") and is_local("localhost:8001") and is_local("[::1]:8001")
    assert not is_local("10.0.0.5:8001") and not is_local("triton.example:8001")
    assert Client("10.0.0.5:8001", shm_threshold=0).shm_threshold is None


def test_infer_async_and_many_keep_order(served_models):
    inputs = [random_input(20 + i, (1, 2 + i, 64)) for i in range(8)]
    with Client(served_models.grpc_address, concurrency=4) as client:
        future = client.infer_async("tiny", {"hidden_states": inputs[0]}, version="1")
        many = client.infer_many("tiny", [{"hidden_states": x} for x in inputs], version="1")
        assert np.array_equal(future.result(timeout=60)["output"], many[0]["output"])
    for x, outputs in zip(inputs, many):
        assert outputs["output"].shape == x.shape
        assert np.abs(outputs["output"] - tiny_reference("1", torch.from_numpy(x)).numpy()).max() < 1e-5


def test_unavailable_server_is_retried_then_reported_in_one_line():
    start = time.monotonic()
    with Client("127.0.0.1:1", retries=2) as client, pytest.raises(ClientError) as caught:
        client.health()
    elapsed = time.monotonic() - start
    assert elapsed >= 1.5  # waited 0.5 s and 1 s before its two retries
    message = str(caught.value)
    assert "no Triton server answers at 127.0.0.1:1" in message and "\n" not in message


def test_timeout_is_reported_as_such(served_models):
    with Client(served_models.grpc_address, retries=0) as client:
        with pytest.raises(ClientError, match=r"infer 'tiny' version 1: no answer within 0.001 s \(DEADLINE_EXCEEDED\)"):
            client.infer("tiny", {"hidden_states": random_input(4, (1, 512, 64))}, version="1", timeout=0.001)


def test_wrong_inputs_are_refused_with_the_model_inputs_named(served_models):
    with Client(served_models.grpc_address) as client:
        with pytest.raises(ClientError, match=r"has no input\(s\) \['hidden'\]; its inputs are \['hidden_states'\]"):
            client.infer("tiny", {"hidden": random_input(0)})
        with pytest.raises(ClientError, match="INVALID_ARGUMENT") as caught:
            client.infer("tiny", {"hidden_states": random_input(0, (2, 4, 32))})
        assert "\n" not in str(caught.value)
