"""Build an engine directory: one safetensors weight file per rank and the manifest that describes them."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from mdtriton.engine.architectures import architecture
from mdtriton.engine.comm import Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.layers import parallel_specs, shard_state_dict, take_shard
from mdtriton.engine.manifest import EngineLimits, Manifest, WeightFile, file_sha256
from mdtriton.engine.plan import ParallelPlan


def random_tensor(name: str, shape: tuple[int, ...], seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """One full (unsplit) float32 weight, drawn from a generator seeded by (seed, name).

    Seeding per weight lets every rank make its own shard without the rest of the model; scales keep
    activations O(1): matrices ~ N(0, 1/fan_in), norm scales ~ 1, biases small but non-zero (so a bias
    applied twice or on the wrong rank shows).
    """
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)
    generator = torch.Generator(device).manual_seed(key)
    values = torch.randn(shape, generator=generator, device=device)
    if len(shape) >= 2:
        return values / math.sqrt(shape[-1])
    return 1.0 + 0.02 * values if name.endswith("weight") else 0.02 * values


def _meta_module(architecture_name: str, config: dict, plan: ParallelPlan, rank: int) -> torch.nn.Module:
    with torch.device("meta"):
        return architecture(architecture_name)(config, Communicator(plan, rank, torch.device("meta")))


def random_weights(architecture_name: str, config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The full model's random weights (float32, CPU): the reference every plan's shards are cut from."""
    module = _meta_module(architecture_name, config, ParallelPlan(), 0)
    return {name: random_tensor(name, tuple(t.shape), seed) for name, t in module.state_dict().items()}


def random_shard(architecture_name: str, config: dict, plan: ParallelPlan, rank: int, seed: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Rank's shard of random_weights, made one weight at a time (never the whole model in memory).

    Generated on `device`; CPU and CUDA generators differ, so compare shards made on the same kind of device.
    """
    full_shapes = {name: tuple(t.shape) for name, t in _meta_module(architecture_name, config, ParallelPlan(), 0).state_dict().items()}
    module = _meta_module(architecture_name, config, plan, rank)
    specs = parallel_specs(module)
    shard = {}
    for name in module.state_dict():
        full = random_tensor(name, full_shapes[name], seed, device)
        shard[name] = (take_shard(full, *specs[name]) if name in specs else full).to(dtype)
    return shard


def shard_from_full(architecture_name: str, config: dict, plan: ParallelPlan, rank: int,
                    full_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank's shard cut out of full weights (e.g. a checkpoint loaded with load_weights)."""
    return shard_state_dict(_meta_module(architecture_name, config, plan, rank), full_weights)


def build_engine(engine_dir: Path, architecture_name: str, config: dict, plan: ParallelPlan, data_type: str,
                 shard_of_rank: Callable[[int], dict[str, torch.Tensor]], progress: bool = True,
                 limits: EngineLimits = EngineLimits()) -> Manifest:
    """Write each rank's shard (one at a time), then the manifest last.

    The manifest is written only after every weight file, so an interrupted build never looks complete.
    """
    arch = architecture(architecture_name)
    arch.check_plan(config, plan)
    engine_dir = Path(engine_dir)
    engine_dir.mkdir(parents=True, exist_ok=False)
    dtype = TORCH_DTYPES[data_type]
    files = []
    for rank in tqdm(range(plan.world_size), desc="writing rank shards", unit="rank", disable=not progress):
        shard = {name: t.to(dtype).contiguous() for name, t in shard_of_rank(rank).items()}
        path = engine_dir / f"rank{rank}.safetensors"
        save_file(shard, path, metadata={"rank": str(rank), "plan": str(plan)})
        files.append(WeightFile(path.name, path.stat().st_size, file_sha256(path)))
    inputs, outputs = arch.signature(config, data_type)
    manifest = Manifest(architecture_name, config, plan, data_type, inputs, outputs, tuple(files), limits)
    manifest.write(engine_dir)
    return manifest


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Full weights from one safetensors file, as float32."""
    return {name: t.float() for name, t in load_file(path).items()}


def reference_module(architecture_name: str, config: dict, full_weights: dict[str, torch.Tensor], data_type: str,
                     device: str = "cpu") -> torch.nn.Module:
    """The same model on one rank with the full weights: the reference that multi-rank engines must match."""
    module = architecture(architecture_name)(config, Communicator.single(device))
    module.load_state_dict(full_weights)
    return module.to(device=device, dtype=TORCH_DTYPES[data_type]).eval()
