"""An engine's whole-model weights re-assembled from its weight files, and a one-device reference that streams
them in block by block: a second path to check a multi-GPU engine against, also for models that do not fit
one device.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mdtriton.engine.layers import join_shards, parallel_specs
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.modules import meta_module
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import family


class EngineWeights:
    """Full weights read from an engine's weight files (one per tensor-parallel shard)."""

    def __init__(self, engine_dir: Path):
        self.manifest = Manifest.read(engine_dir)
        plan = self.manifest.plan
        self.files = [self.manifest.weight_file(engine_dir, rank) for rank in plan.tp_group_ranks()[0]]
        self.specs = parallel_specs(meta_module(family(self.manifest.architecture), self.manifest.config, plan, 0))

    def read(self, name: str) -> torch.Tensor:
        files = self.files if name in self.specs else self.files[:1]
        parts = []
        for file in files:
            with safe_open(file, "pt") as handle:
                parts.append(handle.get_tensor(name))
        if name not in self.specs:
            return parts[0]
        dim, segments, _, _ = self.specs[name]
        return join_shards(parts, dim, segments)


def streamed_units(module: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, weight-name prefix) of each of the module's children, each list of blocks taken
    block by block."""
    units = []
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList):
            units += [(child, str(index), f"{name}.{index}") for index in range(len(child))]
        else:
            units.append((module, name, name))
    return units


class StreamedUnit(nn.Module):
    """Stands in for one unit of a model (a block, an embedder): at each call it makes the unit afresh, loads its
    weights onto the device, fuses its projections where it has them, runs it, and lets it go."""

    def __init__(self, template: nn.Module, load_weights):
        super().__init__()
        self.template = [template]  # in a list, so it is no child module (its parameters are on meta)
        self.load_weights = load_weights

    def forward(self, *args, **kwargs):
        unit = copy.deepcopy(self.template[0])
        unit.load_state_dict(self.load_weights(unit.state_dict()), assign=True)
        if hasattr(unit, "fuse_projections"):
            unit.fuse_projections()
        return unit(*args, **kwargs)


def streamed_reference(engine_dir: Path, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """The engine's model on one device and one rank, holding one block's weights at a time.

    Before each block runs, its weights are re-assembled from the weight files and put on the device in dtype;
    after, they are dropped. So the whole model never needs to fit the device or the host.
    """
    weights = EngineWeights(engine_dir)
    manifest = weights.manifest
    if manifest.quantization:
        raise ValueError(f"{engine_dir}: a streamed reference re-assembles unquantized engines only "
                         f"(this one is {manifest.weight_type})")
    module = meta_module(family(manifest.architecture), manifest.config, ParallelPlan(), 0).eval()

    def loader(prefix: str):
        def load(names) -> dict[str, torch.Tensor]:
            return {name: weights.read(f"{prefix}.{name}").to(device=device, dtype=dtype) for name in names}
        return load

    for parent, attribute, prefix in streamed_units(module):
        parent.register_module(attribute, StreamedUnit(parent.get_submodule(attribute), loader(prefix)))
    return module
