"""Write a model version into a Triton model repository: NAME/config.pbtxt and NAME/VERSION/{model.py, engine/}."""

from __future__ import annotations

import re
import shutil
from importlib.resources import files
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.build_tools.model_config import read_model_config, write_model_config

ENGINE_DIR = "engine"
# A model's name is its folder in the repository and a part of Triton's URLs: a file name on every system, no path.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_model_name(name: str) -> None:
    """ValueError unless name can name a model: 1 to 100 letters, digits, '.', '_' or '-', starting with a letter or
    digit, without '..' (so no path: it cannot leave the repository)."""
    if not MODEL_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"model name {name!r}: use 1 to 100 letters, digits, '.', '_' or '-', starting with a letter "
                         "or digit, without '..'")


def versions(model_dir: Path) -> list[int]:
    """The numbered version folders of a model, in order."""
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0)


def next_version(model_dir: Path) -> int:
    existing = versions(model_dir)
    return existing[-1] + 1 if existing else 1


def new_version_dir(repository: Path, name: str, version: int | None) -> Path:
    """A fresh, empty version folder; never one that exists (a served version is not rewritten in place)."""
    model_dir = Path(repository) / name
    version = next_version(model_dir) if version is None else version
    if version < 1:
        raise ValueError(f"model versions are positive integers, got {version}")
    version_dir = model_dir / str(version)
    if version_dir.exists():
        raise FileExistsError(f"{version_dir} already exists; versions are never overwritten, build a new one "
                              f"(next free: {next_version(model_dir)})")
    return version_dir


def check_compatible(model_dir: Path, config: mc.ModelConfig) -> None:
    """Versions of one model share its config.pbtxt: a new version must keep its instances and signature."""
    path = model_dir / "config.pbtxt"
    if not path.exists():
        return
    existing = read_model_config(path)
    differences = [field for field in ("instance_group", "input", "output", "max_batch_size", "backend",
                                       "model_transaction_policy")
                   if getattr(existing, field) != getattr(config, field)]
    differences += [f"parameter {key}" for key in ("architecture", "parallel_plan")
                    if key in existing.parameters and existing.parameters[key] != config.parameters[key]]
    if differences:
        raise ValueError(
            f"{path}: the new version's {differences[0]} differs from the model's config; all versions of a "
            f"model share config.pbtxt (same architecture, plan, ranks and inputs), so build it under a new model name")


def keep_model_settings(model_dir: Path, config: mc.ModelConfig) -> None:
    """A new version keeps what was set on the model by an earlier build or by hand: its version_policy
    (unless the new build sets one) and every parameter the build does not write (e.g. EXECUTION_ENV_PATH)."""
    path = model_dir / "config.pbtxt"
    if not path.exists():
        return
    existing = read_model_config(path)
    if existing.HasField("version_policy") and not config.HasField("version_policy"):
        config.version_policy.CopyFrom(existing.version_policy)
    for key, value in existing.parameters.items():
        if key not in config.parameters:
            config.parameters[key].CopyFrom(value)


def install_version(version_dir: Path, config: mc.ModelConfig) -> None:
    """Add model.py to a version folder that already holds its engine, then write the model's config."""
    shutil.copyfile(files("mdtriton.backend").joinpath("model.py"), version_dir / "model.py")
    write_model_config(version_dir.parent / "config.pbtxt", config)
