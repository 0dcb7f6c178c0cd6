"""An adapter's file: what a user gives (any format diffusers' LoRA loader of the pipeline reads) and the one form
the repository keeps.

diffusers' loaders convert the community formats (kohya's lora_down/lora_up, XLabs, BFL for FLUX; the original and
musubi formats for Wan) to its own peft keys, and say which alpha each module has; the per-module scaling is then
derived as diffusers derives it (its LoraConfig: rank and alpha patterns, rsLoRA), so an adapter here changes the
weights as `load_lora_weights` + `set_adapters` change diffusers' transformer.

The kept form is a safetensors file: `MODULE.lora_A.weight` [rank, in] and `MODULE.lora_B.weight` [out, rank] for each
module (diffusers' name, without the `transformer.` prefix), and the scalings in its metadata.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

# The file a directory given to `mdtriton lora add` holds (as FluxPipeline.save_lora_weights writes it).
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
METADATA_KEY = "mdtriton_lora"
# The pipeline component the adapters change: diffusers' loaders load into `transformer` unless told otherwise.
TRANSFORMER_PREFIX = "transformer."


class AdapterError(ValueError):
    """An adapter file that cannot be used; the message says why and what to give instead."""


@dataclass(frozen=True)
class Factors:
    """One module's LoRA: its weight becomes W + scale * scaling * B A."""

    lora_a: torch.Tensor  # [rank, in]
    lora_b: torch.Tensor  # [out, rank]
    scaling: float  # alpha / rank (alpha / sqrt(rank) for rsLoRA), as diffusers' peft layer scales it

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


def read_user_adapter(path: Path, diffusers_class: str) -> dict[str, Factors]:
    """The transformer modules' factors of the LoRA at path (a .safetensors file, or a directory holding
    pytorch_lora_weights.safetensors), read by the LoRA loader of the diffusers pipeline class; AdapterError if it is
    not a LoRA file that loader reads, or changes more than the transformer's linear layers."""
    import diffusers  # the `pipeline` extra
    from diffusers.utils.peft_utils import _create_lora_config
    from peft.utils.other import get_pattern_key

    if not hasattr(getattr(diffusers, diffusers_class), "lora_state_dict"):
        raise AdapterError(f"diffusers' {diffusers_class} has no LoRA loader: its models take no adapters")
    path = Path(path)
    file = path / DIFFUSERS_FILE if path.is_dir() else path
    if not file.is_file():
        raise AdapterError(f"{path}: no such file" + (f" (a directory must hold {DIFFUSERS_FILE})"
                                                      if path.is_dir() else ""))
    loader = getattr(diffusers, diffusers_class)
    with_alphas = "return_alphas" in inspect.signature(loader.lora_state_dict).parameters
    try:
        if with_alphas:
            state_dict, alphas, metadata = loader.lora_state_dict(str(file), return_alphas=True,
                                                                  return_lora_metadata=True)
        else:
            (state_dict, metadata), alphas = loader.lora_state_dict(str(file), return_lora_metadata=True), None
    except (OSError, ValueError, KeyError, IndexError, RuntimeError, SafetensorError) as error:
        raise AdapterError(f"{path}: not a LoRA file that diffusers' {diffusers_class} reads: "
                           f"{type(error).__name__}: {error}") from None
    others = sorted({key.split(".")[0] for key in state_dict if not key.startswith(TRANSFORMER_PREFIX)})
    if others:
        raise AdapterError(f"{path}: the adapter also changes {', '.join(others)}; mdtriton applies adapters to the "
                           "transformer only: give an adapter of the transformer alone")
    weights = {key.removeprefix(TRANSFORMER_PREFIX): value for key, value in state_dict.items()}
    if not with_alphas:  # a loader that keeps network alphas in the state dict (Wan's): diffusers' peft ignores them
        weights = {key: value for key, value in weights.items() if not key.endswith(".alpha")}
    if not weights:
        raise AdapterError(f"{path}: holds no LoRA weights")
    unusable = sorted(key for key in weights if not key.endswith((".lora_A.weight", ".lora_B.weight")))
    if unusable:
        raise AdapterError(f"{path}: holds {unusable[0]} ({len(unusable)} such tensors): mdtriton serves LoRA "
                           "factors (lora_A, lora_B) only, not DoRA, LoRA biases or replaced norms")
    modules = sorted({key.rsplit(".lora_", 1)[0] for key in weights})
    for module in modules:
        for factor in ("lora_A", "lora_B"):
            if f"{module}.{factor}.weight" not in weights:
                raise AdapterError(f"{path}: module {module} has no {factor}")
    # Scalings as diffusers' load_lora_adapter derives them: its LoraConfig from the ranks, alphas and metadata.
    ranks = {f"^{module}.lora_B.weight": weights[f"{module}.lora_B.weight"].shape[1] for module in modules}
    if alphas:
        alphas = {key.removeprefix(TRANSFORMER_PREFIX): value for key, value in alphas.items()
                  if key.startswith(TRANSFORMER_PREFIX)}
    if metadata is not None:
        metadata = {key.removeprefix(TRANSFORMER_PREFIX): value for key, value in metadata.items()
                    if key.startswith(TRANSFORMER_PREFIX)}
    config = _create_lora_config(weights, alphas, metadata, ranks)
    if config.use_dora:
        raise AdapterError(f"{path}: a DoRA adapter; mdtriton serves plain LoRA")
    factors = {}
    for module in modules:
        rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        if rank < 1:
            raise AdapterError(f"{path}: module {module} has rank {rank}; a LoRA's factors have rank 1 or more")
        factors[module] = Factors(weights[f"{module}.lora_A.weight"], weights[f"{module}.lora_B.weight"],
                                  float(alpha) / (math.sqrt(rank) if config.use_rslora else rank))
    check_finite_factors(factors, path)
    return factors


def check_finite_factors(factors: dict[str, Factors], path: Path) -> None:
    """AdapterError naming the first module (of the adapter at path) whose factors or scaling hold a NaN or an
    infinity: such an adapter would make every image it changes flat, answered as if it were right."""
    for module, module_factors in factors.items():
        if not math.isfinite(module_factors.scaling):
            raise AdapterError(f"{path}: module {module} has scaling {module_factors.scaling}; give an adapter whose "
                               "alphas and ranks make finite scalings")
        for factor, tensor in (("lora_A", module_factors.lora_a), ("lora_B", module_factors.lora_b)):
            if not bool(torch.isfinite(tensor).all()):
                raise AdapterError(f"{path}: module {module}'s {factor} holds NaN or infinite values; give an adapter "
                                   "of finite weights (retrain or re-export it)")


def write_adapter(path: Path, factors: dict[str, Factors]) -> None:
    """Keep factors at path, whole or not at all (written beside it, then renamed over it)."""
    tensors = {}
    for module, module_factors in factors.items():
        # Copies: converted formats share factors between modules (kohya's joined q/k/v have one A), and safetensors
        # keeps each tensor apart.
        tensors[f"{module}.lora_A.weight"] = module_factors.lora_a.clone(memory_format=torch.contiguous_format)
        tensors[f"{module}.lora_B.weight"] = module_factors.lora_b.clone(memory_format=torch.contiguous_format)
    scalings = {module: module_factors.scaling for module, module_factors in factors.items()}
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, partial, metadata={METADATA_KEY: json.dumps({"scalings": scalings})})
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def read_adapter(path: Path, device: torch.device | str = "cpu") -> dict[str, Factors]:
    """The factors kept at path (write_adapter's form), on device; AdapterError if the file is not one, or holds a
    value that is not finite (a file written by hand, or changed since `mdtriton lora add`)."""
    try:
        with safe_open(path, framework="pt", device=str(device)) as file:
            factors = {module: Factors(file.get_tensor(f"{module}.lora_A.weight"),
                                       file.get_tensor(f"{module}.lora_B.weight"), float(scaling))
                       for module, scaling in kept_scalings(file).items()}
    except (OSError, SafetensorError, KeyError, ValueError, TypeError) as error:
        raise not_kept(path, error) from None
    check_finite_factors(factors, path)
    return factors


def check_adapter(path: Path) -> None:
    """AdapterError if the file at path is not one write_adapter keeps (gone, truncated, damaged in its header, another
    kind of file), from its header alone: what the stub checks of a request's adapters before the ranks read them."""
    try:
        with safe_open(path, framework="pt") as file:
            names = set(file.keys())
            for module in kept_scalings(file):
                for factor in (f"{module}.lora_A.weight", f"{module}.lora_B.weight"):
                    if factor not in names:
                        raise KeyError(factor)
    except (OSError, SafetensorError, KeyError, ValueError, TypeError) as error:
        raise not_kept(path, error) from None


def kept_scalings(file) -> dict[str, float]:
    """The scaling of each module of an open kept adapter (its metadata; KeyError or ValueError if it has none)."""
    return json.loads((file.metadata() or {})[METADATA_KEY])["scalings"]


def not_kept(path: Path, error: Exception) -> AdapterError:
    """The error for a file at path that does not read as a kept adapter (error: what reading it raised)."""
    return AdapterError(f"{path}: not an adapter kept by `mdtriton lora add` ({type(error).__name__}: {error}); add it "
                        "again")
