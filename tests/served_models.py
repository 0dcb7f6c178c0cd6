"""The models that the client, CLI, metrics and perf_analyzer tests share: one repository, one server.

- "tiny" versions 1 and 2: the tiny transformer, tensor-parallel on 2 CPU ranks, random weights from
  different seeds, version_policy all (both served);
- "flux" version 1: the tiny FLUX transformer, context-parallel (ring) on 2 CPU ranks.
Each has a one-rank reference computed in this process from the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux.transformer import TINY_CONFIG as FLUX_CONFIG

TINY_CONFIG = {"hidden_size": 64, "num_heads": 4, "mlp_ratio": 4, "num_layers": 2}
TINY_SEEDS = {"1": 11, "2": 12}
FLUX_SEED = 13
FLUX_PLAN = ParallelPlan(cp_size=2, cp_method="ring")


def build_tiny_versions(repository: Path, name: str = "tiny") -> None:
    """Versions 1 and 2 of the tiny transformer (seeds TINY_SEEDS), both served (version_policy all)."""
    for version, seed in TINY_SEEDS.items():
        build_model_version(repository, name, BuildRequest(
            "tiny_transformer", TINY_CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=seed, version=int(version),
            policy="all", progress=False))


def build_served_models(repository: Path) -> None:
    build_tiny_versions(repository)
    build_model_version(repository, "flux", BuildRequest(
        "flux", FLUX_CONFIG, FLUX_PLAN, "FP32", "cpu", seed=FLUX_SEED, progress=False))


def tiny_reference(version: str, hidden_states: torch.Tensor) -> torch.Tensor:
    """What version `version` of "tiny" must answer, from one process with the full weights."""
    module = reference_module("tiny_transformer", TINY_CONFIG,
                              random_weights("tiny_transformer", TINY_CONFIG, TINY_SEEDS[version]), "FP32")
    with torch.inference_mode():
        return module(torch.as_tensor(hidden_states))["output"]


def flux_reference_module() -> torch.nn.Module:
    return reference_module("flux", FLUX_CONFIG, random_weights("flux", FLUX_CONFIG, FLUX_SEED), "FP32")
