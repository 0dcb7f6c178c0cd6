"""CUDA shared memory on a GPU host: CUDA tensors in, same answers as through gRPC messages, nothing left."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.grpc_client import Client
from mdtriton.client.server_key import key_headers
from mdtriton.engine.plan import ParallelPlan

pytestmark = pytest.mark.gpu
CONFIG = {"hidden_size": 1024, "num_heads": 16, "mlp_ratio": 4, "num_layers": 2}


def cuda_regions(url: str) -> dict:
    status = grpcclient.InferenceServerClient(url).get_cuda_shared_memory_status(headers=key_headers(url), as_json=True)
    return status.get("regions", {})


def test_cuda_shared_memory_gives_the_same_answers(tmp_path, server_factory):
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401 - needs cuda-python
    except RuntimeError:
        pytest.fail("CUDA shared memory needs cuda-python: pip install 'mdtriton[cuda]'")
    world_size = min(torch.cuda.device_count(), 2)
    build_model_version(tmp_path / "repo", "tiny", BuildRequest(
        "tiny_transformer", CONFIG, ParallelPlan(tp_size=world_size), "BF16", "gpu", seed=5, progress=False))
    server = server_factory(tmp_path / "repo")
    inputs = [torch.randn(1, 256 + 64 * i, 1024, device="cuda", dtype=torch.bfloat16,
                          generator=torch.Generator("cuda").manual_seed(i)) for i in range(3)]
    with Client(server.grpc_address, shm_threshold=None) as plain:
        expected = [plain.infer("tiny", {"hidden_states": x})["output"] for x in inputs]
    with Client(server.grpc_address, shm_threshold=0) as shared:
        # Twice: the first time only the inputs go through CUDA shared memory, then the outputs too.
        answers = [shared.infer("tiny", {"hidden_states": x})["output"] for x in inputs + inputs]
        assert cuda_regions(server.grpc_address)  # registered while the client is open
    assert cuda_regions(server.grpc_address) == {}
    for answer, reference in zip(answers, expected + expected):
        assert answer.dtype == reference.dtype
        np.testing.assert_array_equal(answer.astype(np.float32), reference.astype(np.float32))
