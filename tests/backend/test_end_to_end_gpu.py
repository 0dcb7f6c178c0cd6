"""The end-to-end path on GPUs: KIND_GPU instances, NCCL, bf16, checked against a 1-GPU reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.client.grpc_client import Client, to_torch

from mdtriton.engine.plan import ParallelPlan
from mdtriton.harness import relative_error

pytestmark = pytest.mark.gpu
CONFIG = {"hidden_size": 1024, "num_heads": 16, "mlp_ratio": 4, "num_layers": 4}



def max_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpu_ranks_match_one_gpu_bf16(tmp_path, server_factory, world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    build_model_version(tmp_path / "repo", "tiny", BuildRequest(
        "tiny_transformer", CONFIG, ParallelPlan(tp_size=world_size), "BF16", "gpu", seed=11, progress=False))
    server = server_factory(tmp_path / "repo")
    module = reference_module("tiny_transformer", CONFIG, random_weights("tiny_transformer", CONFIG, 11), "BF16", "cuda")
    inputs = [torch.randn(1, 256, 1024, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in range(32)]
    with torch.inference_mode():
        expected = [module(x.cuda())["output"].cpu() for x in inputs]

    def ask(i):
        with Client(server.grpc_address, timeout=120) as client:
            return to_torch(client.infer("tiny", {"hidden_states": inputs[i]})["output"])

    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(ask, range(32)))
    errors = [relative_error(o, e) for o, e in zip(outputs, expected)]
    worst_element = max(max_relative_error(o, e) for o, e in zip(outputs, expected))
    print(f"{world_size} GPUs vs 1 GPU (bf16), 32 concurrent requests: relative error (norm) {max(errors):.2e}, "
          f"largest element difference / largest value {worst_element:.2e}")
    assert all(o.dtype == torch.bfloat16 for o in outputs)
    assert max(errors) < 1e-2
