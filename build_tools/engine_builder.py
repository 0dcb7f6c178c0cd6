"""Build an engine directory: one safetensors weight file per rank and the manifest that describes them."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from mdtriton.engine.architectures import architecture
from mdtriton.engine.comm import Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.layers import shard_state_dict
from mdtriton.engine.manifest import Manifest, WeightFile, file_sha256
from mdtriton.engine.plan import ParallelPlan


def random_weights(architecture_name: str, config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsplit) float32 weights drawn from a seeded generator, scaled so activations stay O(1)."""
    module = architecture(architecture_name)(config, Communicator.single())
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in module.state_dict().items():
        if tensor.dim() >= 2:
            std = 1.0 / math.sqrt(tensor.shape[-1])
            weights[name] = torch.randn(tensor.shape, generator=generator) * std
        elif name.endswith("weight"):  # norm scales
            weights[name] = 1.0 + 0.02 * torch.randn(tensor.shape, generator=generator)
        else:  # biases: small but non-zero, so a bias applied twice or on the wrong rank shows
            weights[name] = 0.02 * torch.randn(tensor.shape, generator=generator)
    return weights


def build_engine(engine_dir: Path, architecture_name: str, config: dict, plan: ParallelPlan, data_type: str,
                 full_weights: dict[str, torch.Tensor], progress: bool = True) -> Manifest:
    """Cut each rank's shard out of full_weights, write it, and write the manifest last.

    The manifest is written only after every weight file, so an interrupted build never looks complete.
    """
    arch = architecture(architecture_name)
    arch.check_plan(config, plan)
    engine_dir = Path(engine_dir)
    engine_dir.mkdir(parents=True, exist_ok=False)
    dtype = TORCH_DTYPES[data_type]
    files = []
    for rank in tqdm(range(plan.world_size), desc="writing rank shards", unit="rank", disable=not progress):
        with torch.device("meta"):
            module = arch(config, Communicator(plan, rank, torch.device("meta")))
        shard = {name: t.to(dtype) for name, t in shard_state_dict(module, full_weights).items()}
        path = engine_dir / f"rank{rank}.safetensors"
        save_file(shard, path, metadata={"rank": str(rank), "plan": str(plan)})
        files.append(WeightFile(path.name, path.stat().st_size, file_sha256(path)))
    inputs, outputs = arch.signature(config, data_type)
    manifest = Manifest(architecture_name, config, plan, data_type, inputs, outputs, tuple(files))
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
