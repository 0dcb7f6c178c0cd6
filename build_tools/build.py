"""Build one model version: engine + model.py + config.pbtxt, written into a Triton model repository."""

from __future__ import annotations

import shutil
from pathlib import Path

from mdtriton.build_tools.engine_builder import build_engine, load_weights, random_shard, shard_from_full
from mdtriton.build_tools.model_config import model_config, version_policy
from mdtriton.build_tools.repository import (ENGINE_DIR, check_compatible, install_version, keep_model_settings,
                                              new_version_dir)
from mdtriton.engine.architectures import architecture
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan


def build_model_version(repository: Path, name: str, architecture_name: str, config: dict | None,
                        plan: ParallelPlan, data_type: str, device: str, gpus: list[int] | None = None,
                        seed: int = 0, weights_path: Path | None = None, version: int | None = None,
                        request_timeout_s: float = 300.0, policy: str | None = None, progress: bool = True) -> Path:
    """Write repository/name/version/ and return its path.

    policy: the model's version_policy ('all', 'latest:K', 'specific:V1,V2'); None keeps the model's
    current one (Triton's default, latest:1, for a new model).

    The version is assembled in a hidden folder (Triton ignores names that are not numbers) and
    renamed into place at the end, so a failed or interrupted build never leaves a half version.
    """
    arch = architecture(architecture_name)
    config = {**arch.default_config(), **(config or {})}
    arch.check_plan(config, plan)
    version_dir = new_version_dir(Path(repository), name, version)
    inputs, outputs = arch.signature(config, data_type)
    probe = Manifest(architecture_name, config, plan, data_type, inputs, outputs)
    triton_config = model_config(name, probe, device, gpus, request_timeout_s)
    check_compatible(version_dir.parent, triton_config)
    if policy is not None:
        triton_config.version_policy.CopyFrom(version_policy(policy))
    keep_model_settings(version_dir.parent, triton_config)
    if weights_path:
        full_weights = load_weights(weights_path)
        shard_of_rank = lambda rank: shard_from_full(architecture_name, config, plan, rank, full_weights)  # noqa: E731
    else:
        shard_of_rank = lambda rank: random_shard(architecture_name, config, plan, rank, seed)  # noqa: E731
    staging = version_dir.parent / f".building-{version_dir.name}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        build_engine(staging / ENGINE_DIR, architecture_name, config, plan, data_type, shard_of_rank, progress)
        install_version(staging, triton_config)
        staging.rename(version_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return version_dir
