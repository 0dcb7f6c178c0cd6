"""A rank's adapters: loaded from the model's adapters directory when a request first names them, split like the
weights they change, and added into this rank's transformer weights for the requests that name them.

Each adapter's factors are split as the weight of their module is: a column-parallel layer's B by its rows (the
rank's output features), a row-parallel layer's A by its columns (the rank's input features), the factors of a
replicated layer kept whole; a module that the engine joined with others (FLUX's q, k and v in one GEMM) changes its
rows of the joined weight. So each rank computes only its own part of every update, with no collective.

A request's adapters are *merged* into the weights: W <- W0 + sum(scale * scaling * B A), in one GEMM per weight
(cuBLAS accumulates in float32 and rounds once), so a forward with adapters costs what one without costs, and the
compiled code and CUDA graphs, which read the weights in place, run as they are (no recompilation, no new
capture). The weights an adapter changes are first copied aside (W0), once, on the same device, and copied back
when a request names other adapters or none: a request without adapters gets exactly the base weights. That copy is
the cost in memory: one more copy of the weights the request's adapters change, while they are merged.
FP8 weights (e4m3 with row scales) are dequantized to the engine's compute type (bf16), updated and quantized again
per row (one pass: fused_activations.rows_to_fp8); the copy aside is of the e4m3 values and scales.

Requests that name the same adapters and scales as the one before run with nothing to do. The adapters' factors stay
on the device after their request, the most recently used first, up to `cache_bytes` on this rank (the model's
`lora_cache_mib` parameter); a request's own adapters are always loaded, the least recently used others dropped.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mdtriton.engine.fused_activations import rows_to_fp8
from mdtriton.engine.layers import ColumnParallelLinear, RowParallelLinear, take_shard
from mdtriton.lora.adapter_file import AdapterError, read_adapter
from mdtriton.lora.directory import adapter_path

EVERY_ROW = slice(None)


@dataclass(frozen=True)
class Piece:
    """Rows of one parameter of this rank that a module's weight holds (all, or its part of a joined weight), and
    the columns of the module's A (this rank's share) that feed it: a row-parallel layer held as one matrix per
    input segment has a piece per segment."""

    weight: nn.Parameter
    weight_scale: nn.Parameter | None  # an FP8 layer's row scales
    rows: slice
    columns: slice


@dataclass(frozen=True)
class Location:
    """Where a module of the (unsplit, unjoined) transformer is on this rank, and how its factors split."""

    pieces: tuple[Piece, ...]
    a_segments: list[int] | None  # A's columns split like a row-parallel layer's input, in these segments
    b_segments: list[int] | None  # B's rows split like a column-parallel layer's output, in these segments
    tp_rank: int
    tp_size: int


@dataclass(frozen=True)
class Update:
    """One piece's share of one adapter: that piece's rows become rows + scale * scaling * lora_b @ lora_a."""

    piece: Piece
    lora_a: torch.Tensor  # [rank, the piece's columns]
    lora_b: torch.Tensor  # [the piece's rows, rank]
    scaling: float


@dataclass(frozen=True)
class LoadedAdapter:
    identity: tuple[int, int, int]  # the file's inode, modification time and size: a file added again is read again
    updates: tuple[Update, ...]
    bytes: int


def locate(model: nn.Module, name: str) -> Location:
    """Where the linear module `name` (diffusers' name) is in model (one rank's, its projections joined);
    AdapterError if it has none of that name."""
    try:
        layer = model.get_submodule(name)
    except AttributeError:
        layer = None
    if isinstance(layer, nn.Linear):
        return Location((Piece(layer.weight, None, EVERY_ROW, EVERY_ROW),), None, None, 0, 1)
    if isinstance(layer, ColumnParallelLinear):
        return Location((Piece(layer.weight, layer.weight_scale, EVERY_ROW, EVERY_ROW),), None, layer.out_segments,
                        layer.comm.tp_rank, layer.comm.tp_size)
    if isinstance(layer, RowParallelLinear):
        return Location(row_parallel_pieces(layer), layer.in_segments, None, layer.comm.tp_rank, layer.comm.tp_size)
    parent_name, _, leaf = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        parent = None
    for joined in (parent.children() if parent is not None else ()):
        if isinstance(joined, ColumnParallelLinear) and joined.parts and leaf in joined.parts:
            first = 0
            for part, segments in joined.parts.items():
                rows = sum(segments) // joined.comm.tp_size
                if part == leaf:
                    piece = Piece(joined.weight, joined.weight_scale, slice(first, first + rows), EVERY_ROW)
                    return Location((piece,), None, segments, joined.comm.tp_rank, joined.comm.tp_size)
                first += rows
    raise AdapterError(f"the transformer has no linear module {name}")


def row_parallel_pieces(layer: RowParallelLinear) -> tuple[Piece, ...]:
    """A row-parallel layer's pieces: its weight, or one per input segment where it holds them apart
    (RowParallelLinear.split_segments)."""
    if not hasattr(layer, "segment_weights"):
        return (Piece(layer.weight, layer.weight_scale, EVERY_ROW, EVERY_ROW),)
    pieces, first = [], 0
    for weight in layer.segment_weights:
        pieces.append(Piece(weight, None, EVERY_ROW, slice(first, first + weight.shape[1])))
        first += weight.shape[1]
    return tuple(pieces)


def split_factors(location: Location, lora_a: torch.Tensor, lora_b: torch.Tensor, dtype: torch.dtype,
                  device: torch.device) -> list[tuple[Piece, torch.Tensor, torch.Tensor]]:
    """This rank's factors of each piece of a module, on device: A split by the layer's input segments, B by its
    output segments (take_shard, as the weights were split); the pieces of one module share its B."""
    if location.a_segments is not None:
        lora_a = take_shard(lora_a, 1, location.a_segments, location.tp_rank, location.tp_size)
    if location.b_segments is not None:
        lora_b = take_shard(lora_b, 0, location.b_segments, location.tp_rank, location.tp_size)
    lora_b = lora_b.to(device, dtype).contiguous()
    return [(piece, lora_a[:, piece.columns].to(device, dtype).contiguous(), lora_b) for piece in location.pieces]


class AdapterWeights:
    """The adapters of one rank's transformer module and the weights they are merged into (see the module's doc)."""

    def __init__(self, model: nn.Module, directory: Path, cache_bytes: int, dtype: torch.dtype):
        self.model = model
        self.directory = Path(directory)
        self.cache_bytes = cache_bytes
        self.dtype = dtype  # of the factors on the device (an FP8 engine's compute type)
        self.device = next(model.parameters()).device
        self.loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()
        # The base values of each weight an adapter changes now, and of its row scales (FP8) with their parameter.
        self.saved: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor | None, nn.Parameter | None]] = {}
        self.merged: tuple = ()  # (name, file identity, scale) of the adapters merged now

    def activate(self, scales: dict[str, float]) -> None:
        """Merge exactly these adapters (name: scale) into the weights, the base weights back where none changes
        them; AdapterError if an adapter's file cannot be read as one of this model's."""
        adapters = {name: self._adapter(name) for name in scales}
        merged = tuple((name, adapters[name].identity, float(scales[name])) for name in sorted(scales))
        if merged == self.merged:
            return
        self._drop_unused(keep=set(scales))
        updates: dict[nn.Parameter, list[tuple[Update, float]]] = {}
        for name in sorted(adapters):  # one order, so that the same adapters merge to the same bits whatever the JSON's
            for update in adapters[name].updates:
                updates.setdefault(update.piece.weight, []).append((update, float(scales[name])))
        self.merged = ()
        try:
            with torch.no_grad():
                for weight in [weight for weight in self.saved if weight not in updates]:
                    self._restore(weight)
                for weight, weight_updates in updates.items():
                    self._merge(weight, weight_updates)
        except BaseException:
            with torch.no_grad():
                for weight in list(self.saved):
                    self._restore(weight)
            raise
        self.merged = merged

    def _adapter(self, name: str) -> LoadedAdapter:
        """Adapter `name`, from the cache if its file is the one read before, else read, split and moved here."""
        path = adapter_path(self.directory, name)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise AdapterError(f"no adapter {name!r} in {self.directory} (mdtriton lora list shows them)") from None
        identity = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        adapter = self.loaded.get(name)
        if adapter is None or adapter.identity != identity:
            updates = []
            for module, factors in read_adapter(path).items():
                for piece, lora_a, lora_b in split_factors(locate(self.model, module), factors.lora_a,
                                                           factors.lora_b, self.dtype, self.device):
                    updates.append(Update(piece, lora_a, lora_b, factors.scaling))
            factors_on_device = {id(t): t for update in updates for t in (update.lora_a, update.lora_b)}
            size = sum(t.nbytes for t in factors_on_device.values())
            adapter = LoadedAdapter(identity, tuple(updates), size)
            self.loaded[name] = adapter
        self.loaded.move_to_end(name)
        return adapter

    def _drop_unused(self, keep: set[str]) -> None:
        """Drop the least recently used adapters not in keep while the loaded ones take more than cache_bytes."""
        for name in list(self.loaded):
            if sum(adapter.bytes for adapter in self.loaded.values()) <= self.cache_bytes:
                return
            if name not in keep:
                del self.loaded[name]

    def _restore(self, weight: nn.Parameter) -> None:
        """The base values back into weight (and its row scales), and their copy dropped."""
        values, scales, scale_parameter = self.saved.pop(weight)
        weight.copy_(values)
        if scale_parameter is not None:
            scale_parameter.copy_(scales)

    def _merge(self, weight: nn.Parameter, updates: list[tuple[Update, float]]) -> None:
        """weight <- its base values + the updates (each with its request scale), rows of the same piece in one GEMM."""
        scale_parameter = updates[0][0].piece.weight_scale
        if weight not in self.saved:
            self.saved[weight] = (weight.detach().clone(),
                                  scale_parameter.detach().clone() if scale_parameter is not None else None,
                                  scale_parameter)
        values, scales, _ = self.saved[weight]
        fp8 = scale_parameter is not None
        if fp8:  # dequantized in the engine's compute type (a rounding far below e4m3's), updated, quantized again
            full = values.to(self.dtype).mul_(scales[:, None])
        else:
            full = weight
            weight.copy_(values)
        by_rows: dict[tuple, list[tuple[Update, float]]] = {}
        for update, scale in updates:
            rows = update.piece.rows
            by_rows.setdefault((rows.start, rows.stop), []).append((update, scale))
        for (start, stop), row_updates in by_rows.items():
            dtype = full.dtype
            lora_b = torch.cat([(update.lora_b.float() * (scale * update.scaling)).to(dtype)
                                for update, scale in row_updates], dim=1)
            lora_a = torch.cat([update.lora_a.to(dtype) for update, _ in row_updates], dim=0)
            full[start:stop].addmm_(lora_b, lora_a)
        if fp8:
            quantized = rows_to_fp8(full)
            weight.copy_(quantized.values)
            scale_parameter.copy_(quantized.scale.squeeze(-1))
