"""Adding, listing and removing a model's adapters in its repository (`mdtriton lora add | list | remove`).

`add` reads the user's file with diffusers' LoRA loader of the model's pipeline (mdtriton.lora.adapter_file), checks
every module it changes against each version of the model (a linear layer of its transformer, of the adapter's
shapes), and keeps it in one form in MODEL/loras/. A running server reads it there when a request first names it:
no reload. A file is written whole, then renamed into place, so a rank never reads half of one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mdtriton.build_tools.model_config import read_model_config
from mdtriton.build_tools.repository import ENGINE_DIR, check_model_name, versions
from mdtriton.engine.layers import ParallelLinear
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.modules import meta_module
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import PipelinePart, family, served_part
from mdtriton.lora.adapter_file import METADATA_KEY, AdapterError, Factors, read_user_adapter, write_adapter
from mdtriton.lora.directory import adapter_names, adapter_path, adapters_dir, check_name


@dataclass(frozen=True)
class AdapterSummary:
    name: str
    modules: int  # linear modules it changes
    ranks: tuple[int, ...]  # their ranks, each once, in order
    bytes: int  # its file's size


def model_pipelines(model_dir: Path) -> dict[int, tuple[PipelinePart, str, dict[str, nn.Module]]]:
    """Each version of the model: its pipeline, its transformer's name (our family's, or diffusers' class where the
    pipeline serves diffusers' own transformer: mdtriton.pipeline.generic) and linear layers by name, without memory;
    ValueError if the model has no version, or one that is not a pipeline (adapters are a pipeline's)."""
    model_dir = Path(model_dir)
    found = versions(model_dir)
    if not found:
        raise ValueError(f"{model_dir}: no model versions there; build one first (mdtriton build)")
    config = read_model_config(model_dir / "config.pbtxt")
    engine = config.parameters["engine_dir"].string_value if "engine_dir" in config.parameters else ENGINE_DIR
    pipelines = {}
    for version in found:
        manifest = Manifest.read(model_dir / str(version) / engine)
        part = served_part(manifest.architecture, manifest.config)
        if not isinstance(part, PipelinePart):
            raise ValueError(f"{model_dir.name} version {version} serves a transformer engine "
                             f"({manifest.architecture}), not a pipeline: adapters are for pipeline models")
        engine_dir = model_dir / str(version) / engine
        if part.transformers:
            transformer = Manifest.read(engine_dir / part.transformers[0])
            model = meta_module(family(transformer.architecture), transformer.config, ParallelPlan(), 0)
            transformer_name = transformer.architecture
        else:
            model = diffusers_meta_transformer(engine_dir / "transformer")
            transformer_name = type(model).__name__
        pipelines[version] = (part, transformer_name, {name: layer for name, layer in model.named_modules()
                                                       if isinstance(layer, (nn.Linear, ParallelLinear))})
    return pipelines


def diffusers_meta_transformer(transformer_dir: Path) -> nn.Module:
    """diffusers' transformer of a pipeline directory's transformer folder, without memory: for weight names and
    shapes."""
    import diffusers  # the `pipeline` extra

    config = json.loads((transformer_dir / "config.json").read_text())
    with torch.device("meta"):
        return getattr(diffusers, config["_class_name"]).from_config(config)


def check_fits(factors: dict[str, Factors], layers: dict[str, nn.Module], where: str, transformer_name: str) -> None:
    """AdapterError, naming the first module that does not fit, unless each module is one of the transformer's
    linear layers (by name; where and transformer_name: whose, for the message) whose weight [out, in] the factors
    A [rank, in] and B [out, rank] fit."""
    for module, module_factors in factors.items():
        if module not in layers:
            raise AdapterError(f"the adapter changes {module}, which is not a linear layer of {where}'s "
                               f"{transformer_name} transformer: it was made for another model")
        out_features, in_features = layers[module].weight.shape
        rank = module_factors.rank
        if (tuple(module_factors.lora_a.shape) != (rank, in_features)
                or tuple(module_factors.lora_b.shape) != (out_features, rank)):
            raise AdapterError(
                f"the adapter's {module} has A {list(module_factors.lora_a.shape)} and B "
                f"{list(module_factors.lora_b.shape)}, where {where}'s weight is [{out_features}, {in_features}] "
                f"(A [rank, {in_features}], B [{out_features}, rank]): it was made for another model")


def add_adapter(repository: Path, model: str, path: Path, name: str) -> AdapterSummary:
    """Check the LoRA at path against every version of the model and keep it as adapter `name`."""
    check_model_name(model)
    check_name(name)
    model_dir = Path(repository) / model
    pipelines = model_pipelines(model_dir)
    target = adapter_path(adapters_dir(model_dir), name)
    if target.exists():
        raise ValueError(f"{model} already has an adapter {name!r}; remove it first (mdtriton lora remove) or choose "
                         "another name")
    # The versions of a model share its architecture (config.pbtxt), so one pipeline's loader reads the file for all.
    part = next(iter(pipelines.values()))[0]
    factors = read_user_adapter(path, part.diffusers_class)
    for version, (_, transformer_name, layers) in pipelines.items():
        try:
            check_fits(factors, layers, f"{model} version {version}", transformer_name)
        except AdapterError as error:
            raise AdapterError(f"{path}: {error}") from None
    target.parent.mkdir(exist_ok=True)
    write_adapter(target, factors)
    return summary(target)


def summary(path: Path) -> AdapterSummary:
    with safe_open(path, framework="pt") as file:
        if METADATA_KEY not in (file.metadata() or {}):
            raise AdapterError(f"{path}: not an adapter kept by `mdtriton lora add`")
        ranks = [file.get_slice(key).get_shape()[0] for key in file.keys() if key.endswith(".lora_A.weight")]
    return AdapterSummary(path.name.removesuffix(path.suffix), len(ranks), tuple(dict.fromkeys(ranks)),
                          path.stat().st_size)


def list_adapters(repository: Path, model: str) -> list[AdapterSummary]:
    check_model_name(model)
    model_dir = Path(repository) / model
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir}: no such model")
    directory = adapters_dir(model_dir)
    return [summary(adapter_path(directory, name)) for name in adapter_names(directory)]


def remove_adapter(repository: Path, model: str, name: str) -> None:
    """Remove adapter `name`: requests that name it from now on are refused (ranks that hold it drop it as they
    need room)."""
    check_model_name(model)
    path = adapter_path(adapters_dir(Path(repository) / model), name)
    if not path.is_file():
        raise ValueError(f"{model} has no adapter {name!r} (mdtriton lora list {repository} {model} shows them)")
    path.unlink()
