"""Linear layers named by how they are split across the tensor-parallel group (Megatron style).

Each layer knows how to cut its own shard out of the full (unsplit) weights: `shard_specs()` says,
for each parameter, which dimension is split and into which segments. A segment is a block of that
dimension that is split on its own; a fused weight such as [attention | MLP] is split per part so
every rank gets its share of each part.

With `fp8=True` a layer holds an e4m3 weight and one float32 scale per output row (`weight_scale`), made
from this rank's shard at build time (mdtriton.engine.fp8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.comm import Communicator
from mdtriton.engine.fp8 import FP8_DTYPE, Fp8Rows, fp8_linear
from mdtriton.engine.fused_activations import rows_to_fp8


@torch.library.custom_op("mdtriton::accumulate_matmul", mutates_args=("out",),
                         schema="(Tensor(a!) out, Tensor x, Tensor weight) -> ()")
def accumulate_matmul(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """out += x weight^T for 2-D out and x, in the GEMM itself (out is its C operand). Written as
    torch.addmm(out, ...) in a compiled region, the sum went to a new tensor, and out was first copied into it."""
    out.addmm_(x, weight.t())


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


def join_shards(shards: list[torch.Tensor], dim: int, segments: list[int]) -> torch.Tensor:
    """The inverse of take_shard: the tensor-parallel ranks' shards (in tp rank order) back into the full tensor."""
    shape = list(shards[0].shape)
    shape[dim] = sum(segments)
    full = shards[0].new_empty(shape)
    for tp_rank, shard in enumerate(shards):
        offset = 0
        for start, stop in shard_ranges(segments, tp_rank, len(shards)):
            full.narrow(dim, start, stop - start).copy_(shard.narrow(dim, offset, stop - start))
            offset += stop - start
    return full


class ParallelLinear(nn.Module):
    """A rank's part of a linear layer: weight [local out, local in], optional bias, and in FP8 a row scale."""

    def __init__(self, local_in: int, local_out: int, bias_features: int | None, fp8: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_out, local_in, dtype=FP8_DTYPE if fp8 else None))
        self.weight_scale = nn.Parameter(torch.empty(local_out)) if fp8 else None
        self.bias = nn.Parameter(torch.empty(bias_features)) if bias_features else None

    @property
    def fp8(self) -> bool:
        return self.weight_scale is not None

    def local_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias with this rank's weight (FP8 or not)."""
        return self.linear(x, self.weight, bias)

    def linear(self, x: torch.Tensor | Fp8Rows, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False,
               accumulate: torch.Tensor | None = None) -> torch.Tensor | Fp8Rows:
        """x weight^T + bias, with this layer's weight or a block of its columns, FP8 or not; with gelu, the tanh
        GELU of that; with accumulate (bf16 layers only), added into accumulate in place and returned. Every GEMM
        of the layer runs here.

        Unquantized, an accumulation is the GEMM's own (C in C + A B), and on a GPU a GELU after a bias is applied
        in the GEMM's cuBLASLt epilogue, to the float32 sums: no pass over the output. torch.compile keeps both
        calls as they are. An accumulating GEMM takes no bias (segment_product adds it with the first one).

        FP8: x comes quantized per row (Fp8Rows, from the kernel that made it) or is quantized here in one pass.
        The GELU's output is handed on quantized (its only reader is the next FP8 GEMM): GELU and quantization
        in one pass over the GEMM's output."""
        if accumulate is not None and (bias is not None or self.fp8):
            raise ValueError("an accumulating GEMM takes no bias (add it with the first GEMM) and is not FP8")
        if self.fp8:
            out = fp8_linear(x if isinstance(x, Fp8Rows) else rows_to_fp8(x), weight, self.weight_scale, bias)
            return rows_to_fp8(out, gelu=True) if gelu else out
        if accumulate is not None:
            accumulate_matmul(accumulate.view(-1, weight.shape[0]), x.reshape(-1, x.shape[-1]), weight)
            out = accumulate
        elif gelu and x.is_cuda and bias is not None:
            rows = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
            return rows.view(*x.shape[:-1], weight.shape[0])
        else:
            out = F.linear(x, weight, bias)
        return F.gelu(out, approximate="tanh") if gelu else out


class ColumnParallelLinear(ParallelLinear):
    """y = x W^T + b with W's output rows split across ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 out_segments: list[int] | None = None, fp8: bool = False):
        segments = split_sizes(out_features, out_segments, comm.tp_size)
        local_out = out_features // comm.tp_size
        super().__init__(in_features, local_out, local_out if bias else None, fp8)
        self.comm = comm
        self.out_segments = segments
        self.parts: dict[str, list[int]] | None = None  # the layers it joins, if fused (fuse_columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local_linear(x, self.bias)

    def forward_gelu(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor | Fp8Rows:
        """tanh-GELU(forward(x)), on GPUs in the GEMM's epilogue; in FP8 layers quantized for the next (see linear)."""
        return self.linear(x, self.weight, self.bias, gelu=True)

    def shard_specs(self) -> dict[str, tuple[int, list[int]]]:
        specs = {"weight": (0, self.out_segments)}
        if self.bias is not None:
            specs["bias"] = (0, self.out_segments)
        return specs


def fuse_columns(layers: dict[str, ColumnParallelLinear]) -> ColumnParallelLinear:
    """One column-parallel layer computing [layer(x) for layer in layers] concatenated, with one GEMM.

    Each rank concatenates its own slices, so the fused layer holds this rank's share of every part, in order. Its
    `parts` keeps each part's name (the layer's, under the same parent) and output segments, so a change to one of
    the joined layers (a LoRA adapter: mdtriton.lora.weights) finds its rows.
    """
    first = next(iter(layers.values()))
    comm, in_features = first.comm, first.weight.shape[1]
    segments = [segment for layer in layers.values() for segment in layer.out_segments]
    with torch.device("meta"):
        fused = ColumnParallelLinear(in_features, sum(segments), comm, bias=first.bias is not None,
                                     out_segments=segments, fp8=first.fp8)
    for name in ("weight", "weight_scale", "bias"):
        if getattr(fused, name) is not None:
            setattr(fused, name, nn.Parameter(torch.cat([getattr(layer, name) for layer in layers.values()])))
    fused.parts = {name: layer.out_segments for name, layer in layers.items()}
    return fused


class RowParallelLinear(ParallelLinear):
    """y = x W^T + b with W's input columns split; partial products are summed by AllReduce.

    In FP8 each rank's row scales are those of its own columns (quantized after the split)."""

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 in_segments: list[int] | None = None, fp8: bool = False):
        segments = split_sizes(in_features, in_segments, comm.tp_size)
        super().__init__(in_features // comm.tp_size, out_features, out_features if bias else None, fp8)
        self.comm = comm
        self.in_segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rank 0 adds the bias inside its GEMM (no extra kernel; on one rank the exact nn.Linear math), so
        # the sum holds it once. The partial products are summed in the engine's dtype: summing them in
        # float32 instead was measured 10% slower and no closer to one GPU (docs/benchmarks.md).
        bias = self.bias if self.comm.tp_rank == 0 else None
        return self.comm.tp_all_reduce(self.local_linear(x, bias))

    def split_segments(self) -> None:
        """Hold this rank's weight as one matrix per input segment (segment_product then takes the segments'
        inputs apart, with no concatenation); call once the weights are loaded. bf16 layers only: an FP8 layer's
        input is quantized per row into one tensor (mdtriton.engine.fused_activations) and runs one GEMM."""
        if self.fp8:
            raise ValueError("FP8 layers are not split by segments: give forward one quantized input")
        sizes = [size // self.comm.tp_size for size in self.in_segments]
        self.segment_weights = nn.ParameterList(
            nn.Parameter(part.contiguous()) for part in self.weight.split(sizes, dim=1))
        del self.weight

    def segment_product(self, index: int, x: torch.Tensor, accumulate: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of forward(torch.cat(inputs, dim=-1)) that input segment `index` (its input x) gives: x
        times the segment's weight (split_segments), added into `accumulate` (the product of another segment) in the
        GEMM's epilogue if given; the first product of a sum (no accumulate) adds the bias, on tp rank 0. Summed
        over the segments and all-reduced over the tensor-parallel group, the products are forward's output.

        Written out, the concatenation was the slowest kernel of FLUX's single blocks (docs/benchmarks.md)."""
        if accumulate is not None:
            return self.linear(x, self.segment_weights[index], None, accumulate=accumulate)
        return self.linear(x, self.segment_weights[index], self.bias if self.comm.tp_rank == 0 else None)

    def shard_specs(self) -> dict[str, tuple[int, list[int]]]:
        return {"weight": (1, self.in_segments)}


def parallel_specs(model: nn.Module) -> dict[str, tuple[int, list[int], int, int]]:
    """For each split parameter of model (built for one rank): (dim, segments, tp_rank, tp_size). A split module
    says how with `shard_specs()` and holds the rank's Communicator as `comm` (ColumnParallelLinear,
    RowParallelLinear, ColumnParallelRMSNorm)."""
    specs = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "shard_specs"):
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


class ColumnParallelRMSNorm(nn.Module):
    """RMSNorm over the features of a column-parallel layer's output (e.g. q across all heads, as Wan normalises
    it): each rank holds the weight of its own columns, and the mean square is over every rank's features, from
    sums of squares that the caller has added up across the tensor-parallel group (sums_of_squares: one AllReduce
    for several norms)."""

    def __init__(self, features: int, comm: Communicator, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(features // comm.tp_size))
        self.comm = comm
        self.features = features
        self.eps = eps

    def forward(self, x: torch.Tensor, sum_of_squares: torch.Tensor) -> torch.Tensor:
        """x [..., local features] normalised by its row's sum of squares over all ranks [..., 1] (float32), in
        float32 as torch's rms_norm computes, then scaled by the weight."""
        return rms_norm_of_squares(x, sum_of_squares, self.weight, self.features, self.eps)

    def shard_specs(self) -> dict[str, tuple[int, list[int]]]:
        return {"weight": (0, [self.features])}


def rms_norm_of_squares(x: torch.Tensor, sum_of_squares: torch.Tensor, weight: torch.Tensor, features: int,
                        eps: float) -> torch.Tensor:
    """x [..., local features] normalised by its rows' sums of squares over all `features` [..., 1] (float32), in
    float32 as torch's rms_norm computes, rounded to x's type, then scaled by the weight."""
    normed = (x.float() * torch.rsqrt(sum_of_squares / features + eps)).to(x.dtype)
    return normed * weight.to(x.dtype)


def sums_of_squares(comm: Communicator, *parts: torch.Tensor) -> list[torch.Tensor]:
    """Each part's per-row sum of squares [..., 1] (float32) over the whole feature dimension, the parts' columns
    being split across the tensor-parallel group: one AllReduce for all of them."""
    sums = [part.float().pow(2).sum(-1, keepdim=True) for part in parts]
    if comm.tp_size == 1:
        return sums
    summed = comm.tp_all_reduce(torch.cat([local.reshape(-1) for local in sums]))
    return [piece.view_as(local) for piece, local in zip(summed.split([local.numel() for local in sums]), sums)]
