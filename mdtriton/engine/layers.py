"""Linear layers named by how they are split across the tensor-parallel group (Megatron style).

Each layer knows how to cut its own shard out of the full (unsplit) weights: `shard_specs()` says,
for each parameter, which dimension is split and into which segments. A segment is a block of that
dimension that is split on its own; a fused weight such as [attention | MLP] is split per part so
every rank gets its share of each part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.comm import Communicator


def split_sizes(total: int, segments: list[int] | None, tp_size: int) -> list[int]:
    """Check that each segment divides by tp_size; return the segments (the whole dim if none)."""
    segments = list(segments) if segments else [total]
    if sum(segments) != total:
        raise ValueError(f"segments {segments} do not add up to {total}")
    for size in segments:
        if size % tp_size:
            raise ValueError(f"a dimension of size {size} does not divide by tensor-parallel size {tp_size}")
    return segments


def shard_ranges(segments: list[int], tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges of the split dimension that this rank holds: its part of every segment."""
    ranges, offset = [], 0
    for size in segments:
        part = size // tp_size
        ranges.append((offset + tp_rank * part, offset + (tp_rank + 1) * part))
        offset += size
    return ranges


def take_shard(full: torch.Tensor, dim: int, segments: list[int], tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of every segment of `full` along dim, concatenated."""
    parts = [full.narrow(dim, start, stop - start) for start, stop in shard_ranges(segments, tp_rank, tp_size)]
    return torch.cat(parts, dim=dim).contiguous()


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 out_segments: list[int] | None = None):
        super().__init__()
        self.comm = comm
        self.out_segments = split_sizes(out_features, out_segments, comm.tp_size)
        local_out = out_features // comm.tp_size
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.empty(local_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_specs(self) -> dict[str, tuple[int, list[int]]]:
        specs = {"weight": (0, self.out_segments)}
        if self.bias is not None:
            specs["bias"] = (0, self.out_segments)
        return specs


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split; partial products are summed by AllReduce."""

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 in_segments: list[int] | None = None):
        super().__init__()
        self.comm = comm
        self.in_segments = split_sizes(in_features, in_segments, comm.tp_size)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // comm.tp_size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rank 0 adds the bias inside its GEMM (no extra kernel; on one rank the exact nn.Linear math), so
        # the sum holds it once. The partial products are summed in the engine's dtype: summing them in
        # float32 instead was measured 10% slower and no closer to one GPU (docs/benchmarks.md).
        bias = self.bias if self.comm.tp_rank == 0 else None
        return self.comm.tp_all_reduce(F.linear(x, self.weight, bias))

    def shard_specs(self) -> dict[str, tuple[int, list[int]]]:
        return {"weight": (1, self.in_segments)}


def parallel_specs(model: nn.Module) -> dict[str, tuple[int, list[int], int, int]]:
    """For each split parameter of model (built for one rank): (dim, segments, tp_rank, tp_size)."""
    specs = {}
    for prefix, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            for name, (dim, segments) in module.shard_specs().items():
                specs[f"{prefix}.{name}" if prefix else name] = (dim, segments, module.comm.tp_rank, module.comm.tp_size)
    return specs


def shard_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cut this rank's weights for `model` (built for one rank of a plan) out of the full weights.

    Parameters of parallel layers are split by their shard_specs; all others are copied whole.
    """
    specs = parallel_specs(model)
    local = {}
    for name, expected in model.state_dict().items():
        if name not in full_state:
            raise KeyError(f"weight {name!r} is missing from the full weights")
        full = full_state[name]
        if name in specs:
            full = take_shard(full, *specs[name])
        if tuple(full.shape) != tuple(expected.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(full.shape)}, expected {tuple(expected.shape)}")
        local[name] = full
    return local
