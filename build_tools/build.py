"""Build one model version: engine + model.py + config.pbtxt, written into a Triton model repository."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.build_tools.checkpoint import Checkpoint
from mdtriton.build_tools.engine_builder import RandomWeights, build_engine, full_shapes
from mdtriton.build_tools.model_config import model_config, version_policy
from mdtriton.build_tools.repository import (ENGINE_DIR, check_compatible, install_version, keep_model_settings,
                                              new_version_dir)
from mdtriton.engine.architectures import architecture, check_quantization
from mdtriton.engine.fp8 import Fp8Unsupported, check_fp8_device
from mdtriton.engine.manifest import EngineLimits, Manifest
from mdtriton.engine.memory import check_gpus_fit
from mdtriton.engine.plan import ParallelPlan


# Seconds a request may wait for all ranks (config.pbtxt's request_timeout_s) unless the build says otherwise.
DEFAULT_REQUEST_TIMEOUT_S = 30.0


class BuildInterrupted(Exception):
    """The build was stopped; what it finished is kept for the next run of the same build."""


def build_model_version(repository: Path, name: str, architecture_name: str, config: dict | None,
                        plan: ParallelPlan, data_type: str, device: str, gpus: list[int] | None = None,
                        seed: int = 0, weights_path: Path | None = None, version: int | None = None,
                        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, progress: bool = True, random_device: str = "cpu",
                        policy: str | None = None, limits: EngineLimits = EngineLimits()) -> Path:
    """Write repository/name/version/ and return its path.

    policy: the model's version_policy ('all', 'latest:K', 'specific:V1,V2'); None keeps the model's
    current one (Triton's default, latest:1, for a new model). Parameters added to the model's config by
    hand (e.g. EXECUTION_ENV_PATH) are kept.

    data_type FP8: the blocks' linear weights in e4m3 with row scales, the rest (and inputs, outputs) in BF16;
    only for GPUs that run FP8 GEMMs (compute capability 8.9+), refused here for CPU instances or such GPUs.

    Weights: a checkpoint at weights_path (its config.json, if any, fills the config under `config`), or
    random from seed, generated on random_device. The version is assembled in a hidden folder named after
    the build's inputs (Triton ignores names that are not numbers) and renamed into place at the end, so a
    failed build never leaves a half version, and the same build run again resumes from that folder.
    """
    arch = architecture(architecture_name)
    checkpoint = Checkpoint(weights_path) if weights_path else None
    known = arch.default_config()
    from_checkpoint = {k: v for k, v in checkpoint.config().items() if k in known} if checkpoint else {}
    config = {**known, **from_checkpoint, **(config or {})}
    arch.check_plan(config, plan)
    quantization = "fp8" if data_type == "FP8" else None
    if quantization:
        data_type = "BF16"
        check_quantization(architecture_name, quantization)
        if device != "gpu":
            raise Fp8Unsupported("FP8 engines run on GPUs of compute capability 8.9 or newer; build with "
                                 "--device gpu, or with --dtype FP32 for CPU instances")
    inputs, outputs = arch.signature(config, data_type)
    probe = Manifest(architecture_name, config, plan, data_type, inputs, outputs, quantization=quantization)
    triton_config = model_config(name, probe, device, gpus, request_timeout_s)
    model_dir = prepare_model_dir(Path(repository), name, version, triton_config, policy)
    if device == "gpu":
        gpus = list(triton_config.instance_group[0].gpus)
        check_gpus_fit(probe, gpus)
        if quantization and torch.cuda.is_available():
            for gpu in gpus:
                if gpu < torch.cuda.device_count():
                    check_fp8_device(torch.device("cuda", gpu))
    shapes = full_shapes(architecture_name, config)
    if checkpoint:
        checkpoint.check(shapes)
    source = checkpoint or RandomWeights(shapes, seed, random_device)
    staging = staging_dir(model_dir, {"architecture": architecture_name, "config": config, "plan": plan.to_dict(),
                                      "data_type": data_type, "quantization": quantization,
                                      "weights": source.fingerprint()})
    with resumable(staging):
        build_engine(staging / ENGINE_DIR, architecture_name, config, plan, data_type, source, progress, limits,
                     quantization)
    return finish_version(Path(repository), name, version, staging, triton_config)


def prepare_model_dir(repository: Path, name: str, version: int | None, triton_config: mc.ModelConfig,
                      policy: str | None) -> Path:
    """The model's folder, after checking (before any work) that the version is new and that the model's config
    takes the new version; triton_config gets the policy and keeps the model's own settings."""
    new_version_dir(repository, name, version)
    model_dir = repository / name
    check_compatible(model_dir, triton_config)
    if policy is not None:
        triton_config.version_policy.CopyFrom(version_policy(policy))
    keep_model_settings(model_dir, triton_config)
    return model_dir


def staging_dir(model_dir: Path, build_inputs: dict) -> Path:
    """The hidden folder a build assembles its version in, named after the build's inputs (so a rerun resumes)."""
    key = json.dumps(build_inputs, sort_keys=True)
    return model_dir / f".building-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@contextmanager
def resumable(staging: Path) -> Iterator[None]:
    """A stopped build (Ctrl-C) says where its finished work is kept."""
    try:
        yield
    except KeyboardInterrupt:
        raise BuildInterrupted(f"build interrupted; its finished rank files are kept in {staging}: run the same "
                               "command again to resume") from None


def finish_version(repository: Path, name: str, version: int | None, staging: Path,
                   triton_config: mc.ModelConfig) -> Path:
    """Add model.py and the config to the assembled version and rename it to its version number."""
    install_version(staging, triton_config)
    version_dir = new_version_dir(repository, name, version)
    staging.rename(version_dir)
    return version_dir
