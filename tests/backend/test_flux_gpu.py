"""FLUX served through Triton on 2 GPUs (NCCL, bf16), one model per parallel method, against one GPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.client.grpc_client import Client, to_torch
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.harness import relative_error
from tests.engine.flux_cases import flux_inputs

pytestmark = pytest.mark.gpu
# FLUX.1-dev's head size and rotary axes (the kernels the real model uses), fewer and narrower layers.
CONFIG = {**FLUX.presets()["flux.1-dev"], "num_layers": 2, "num_single_layers": 4, "num_attention_heads": 8,
          "joint_attention_dim": 512}
PLANS = {
    "allgather_kv": ParallelPlan(cp_size=2, cp_method="allgather_kv"),
    "ring": ParallelPlan(cp_size=2, cp_method="ring"),
    "ulysses": ParallelPlan(cp_size=2, cp_method="ulysses"),
    "tp": ParallelPlan(tp_size=2),
}
# 77 text + 1001 image tokens: odd, so the context-parallel ranks pad.
TEXT_TOKENS, IMAGE_TOKENS = 77, 1001



def test_every_method_served_on_two_gpus_matches_one_gpu(tmp_path, server_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for name, plan in PLANS.items():
        build_model_version(tmp_path / "repo", name, BuildRequest(
            "flux", CONFIG, plan, "BF16", "gpu", seed=2, progress=False))
    server = server_factory(tmp_path / "repo")
    reference = reference_module("flux", CONFIG, random_weights("flux", CONFIG, 2), "BF16", "cuda")
    cases = [flux_inputs(CONFIG, TEXT_TOKENS, IMAGE_TOKENS, batch=1, seed=i, dtype=torch.bfloat16) for i in range(4)]
    with torch.inference_mode():
        expected = [reference(**{n: t.cuda() for n, t in case.items()})["sample"].cpu() for case in cases]

    def ask(model_and_case):
        model, i = model_and_case
        with Client(server.grpc_address, timeout=300) as client:
            return model, i, to_torch(client.infer(model, cases[i])["sample"])

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, [(model, i) for model in PLANS for i in range(len(cases))]))
    errors = {}
    for model, i, sample in answers:
        assert sample.dtype == torch.bfloat16 and sample.shape == expected[i].shape
        errors[model] = max(errors.get(model, 0.0), relative_error(sample, expected[i]))
    print("2 GPUs vs 1 GPU, bf16, relative error (norm):", {m: f"{e:.1e}" for m, e in errors.items()})
    assert max(errors.values()) < 1e-2
