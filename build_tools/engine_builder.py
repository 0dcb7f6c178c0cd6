"""Build an engine directory: one safetensors weight file per tensor-parallel shard (shared by the ranks that hold
it) and the manifest that describes them.

Weights come from a source one weight (or one shard's slices of it) at a time: seeded random weights,
or a checkpoint (build_tools.checkpoint). So a shard's file is the most the build holds in memory.
A build is resumable: each finished shard file is recorded with its checksum, and a build run again
into the same directory keeps the files that still match their checksums.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from mdtriton.build_tools.checkpoint import Split
from mdtriton.engine.comm import Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.fp8 import quantize_weight
from mdtriton.engine.layers import parallel_specs, take_shard
from mdtriton.engine.manifest import RANK_FILE_KEY, EngineLimits, Manifest, WeightFile, file_sha256
from mdtriton.engine.modules import loaded_module, meta_module, stored_dtype
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import family

PROGRESS_FILE = "build-progress.json"


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


def full_shapes(architecture_name: str, config: dict) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the whole (one-rank) model."""
    module = meta_module(family(architecture_name), config, ParallelPlan(), 0)
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


class RandomWeights:
    """Seeded random weights; a rank's slices are cut from the full weight, generated on `device`.

    CPU and CUDA generators differ: the same seed gives other weights on another kind of device.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int, device: str = "cpu"):
        self.shapes = shapes
        self.seed = seed
        self.device = device

    def read(self, name: str, split: Split | None = None) -> torch.Tensor:
        full = random_tensor(name, self.shapes[name], self.seed, self.device)
        return take_shard(full, *split) if split else full

    def fingerprint(self) -> dict:
        return {"random_seed": self.seed, "device": torch.device(self.device).type}


def random_weights(architecture_name: str, config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The full model's random weights (float32, CPU): the reference every plan's shards are cut from."""
    source = RandomWeights(full_shapes(architecture_name, config), seed)
    return {name: source.read(name) for name in source.shapes}


def rank_weights(architecture_name: str, config: dict, plan: ParallelPlan, rank: int, source,
                 dtype: torch.dtype, quantization: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank's weights, one at a time, read from source (RandomWeights or a Checkpoint) and cast to dtype (those the
    family keeps in float32 to float32).

    With quantization "fp8", each weight that has a `weight_scale` beside it is quantized from this rank's
    slice (so each rank's row scales fit its own columns) and followed by its scale."""
    module = meta_module(family(architecture_name), config, plan, rank, quantization)
    specs = parallel_specs(module)
    state = module.state_dict()
    for name, local in state.items():
        if name.endswith(".weight_scale"):
            continue  # made with its weight
        tensor = source.read(name, specs.get(name))
        if tuple(tensor.shape) != tuple(local.shape):
            raise ValueError(f"weight {name!r} of rank {rank} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(local.shape)}")
        scale_name = name.removesuffix("weight") + "weight_scale"
        if scale_name in state:
            values, scale = quantize_weight(tensor.float())
            yield name, values
            yield scale_name, scale
        else:
            yield name, tensor.to(stored_dtype(module, name, dtype))


def random_shard(architecture_name: str, config: dict, plan: ParallelPlan, rank: int, seed: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 quantization: str | None = None) -> dict[str, torch.Tensor]:
    """Rank's shard of the seeded random weights, generated on device (never the whole model in memory)."""
    source = RandomWeights(full_shapes(architecture_name, config), seed, str(device))
    return dict(rank_weights(architecture_name, config, plan, rank, source, dtype, quantization))


def _finished_files(engine_dir: Path) -> dict[str, WeightFile]:
    """Shard files an earlier, interrupted build finished, if they still match their recorded checksums."""
    path = engine_dir / PROGRESS_FILE
    if not path.is_file():
        return {}
    finished = {}
    for entry in (WeightFile(**item) for item in json.loads(path.read_text())):
        file = engine_dir / entry.file
        if file.is_file() and file.stat().st_size == entry.bytes and file_sha256(file) == entry.sha256:
            finished[entry.file] = entry
    return finished


def build_engine(engine_dir: Path, architecture_name: str, config: dict, plan: ParallelPlan, data_type: str,
                 source, progress: bool = True, limits: EngineLimits = EngineLimits(),
                 quantization: str | None = None) -> Manifest:
    """Write each tensor-parallel shard's weight file from source (rank t's weights, which every rank of tp index t
    holds), then the manifest (with the request limits) last.

    The manifest is written only after every weight file, so an interrupted build never looks complete;
    run again into the same engine_dir, it keeps the shard files already finished and verified.
    """
    model_family = family(architecture_name)
    model_family.check_plan(config, plan)
    engine_dir = Path(engine_dir)
    engine_dir.mkdir(parents=True, exist_ok=True)
    finished = _finished_files(engine_dir)
    dtype = TORCH_DTYPES[data_type]
    weights_per_shard = len(meta_module(model_family, config, plan, 0, quantization).state_dict())
    inputs, outputs = model_family.signature(config, data_type)
    manifest = Manifest(architecture_name, config, plan, data_type, inputs, outputs, (), limits, quantization)
    files = []
    with tqdm(total=plan.tp_size * weights_per_shard, desc="building engine", unit="weight",
              disable=not progress) as bar:
        for shard_index in range(plan.tp_size):  # rank t: tp index t, the first of its replicas
            path = engine_dir / f"shard{shard_index}.safetensors"
            if path.name in finished:
                files.append(finished[path.name])
                bar.update(weights_per_shard)
                continue
            bar.set_postfix_str(f"shard {shard_index}")
            shard = {}
            for name, tensor in rank_weights(architecture_name, config, plan, shard_index, source, dtype,
                                             quantization):
                shard[name] = tensor.contiguous().cpu()
                bar.update(1)
            # One metadata key: safetensors writes several in a random order, which would change the checksum.
            save_file(shard, path, metadata={RANK_FILE_KEY: manifest.file_label(shard_index)})
            del shard
            files.append(WeightFile(path.name, path.stat().st_size, file_sha256(path)))
            (engine_dir / PROGRESS_FILE).write_text(json.dumps([vars(f) for f in files]))
    manifest = dataclasses.replace(manifest, weights=tuple(files))
    manifest.write(engine_dir)
    (engine_dir / PROGRESS_FILE).unlink(missing_ok=True)
    return manifest


def reference_module(architecture_name: str, config: dict, full_weights: dict[str, torch.Tensor], data_type: str,
                     device: str = "cpu") -> torch.nn.Module:
    """The same model on one rank with the full weights: the reference that multi-rank engines must match."""
    weights = {name: tensor.to(device=device, dtype=TORCH_DTYPES[data_type]) for name, tensor in full_weights.items()}
    return loaded_module(family(architecture_name), config, Communicator.single(device), weights)
