"""Cosmos 3's layers, split rank by rank, with the math of diffusers' Cosmos3OmniTransformer: its RMS norms, the
interleaved 3D multimodal rotary embedding, the token embedding split by vocabulary rows, the gated MLP, and the
key/value heads of grouped-query attention (8 for 32 query heads at the published size) split across the
tensor-parallel ranks where they divide and replicated where they do not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.comm import Communicator
from mdtriton.engine.layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear, fuse_columns


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, nemotron: bool) -> torch.Tensor:
    """x's RMS norm over its last dimension, scaled by weight, as diffusers computes it: its RMSNorm (the Qwen3
    backbone) normalises in float32 and scales in the weight's type; Cosmos3NemotronRMSNorm (relu2 backbone) scales in
    float32 and returns x's type."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    if nemotron:
        return (weight.float() * (x.float() * torch.rsqrt(variance + eps))).to(x.dtype)
    normed = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(weight.dtype)
    return normed * weight


class RMSNorm(nn.Module):
    """A weight [dim] and rms_norm of it (diffusers' RMSNorm or Cosmos3NemotronRMSNorm by `nemotron`)."""

    def __init__(self, dim: int, eps: float, nemotron: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.nemotron = eps, nemotron

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.nemotron)


def rotary(position_ids: torch.Tensor, head_dim: int, theta: float, axes_dim: list[int],
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, head_dim] (in dtype, as diffusers casts them) of position_ids [3, tokens] (temporal, height,
    width; float32): diffusers' Cosmos3VLTextRotaryEmbedding, whose frequencies take their position from the three axes
    interleaved (frequency j from height where j % 3 == 1 and j < 3 * axes_dim[1], from width where j % 3 == 2 and
    j < 3 * axes_dim[2], else from time)."""
    device = position_ids.device
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = position_ids.float()[:, :, None] * inverse  # [3, tokens, head_dim / 2]
    chosen = angles[0].clone()
    for axis in (1, 2):
        picked = slice(axis, 3 * axes_dim[axis], 3)
        chosen[:, picked] = angles[axis, :, picked]
    both = torch.cat((chosen, chosen), dim=-1)
    return both.cos().to(dtype), both.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, tokens, heads, head_dim] rotated by cos and sin [tokens, head_dim], halves rotated (diffusers'
    _rotate_half), in x's type."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class VocabParallelEmbedding(nn.Module):
    """embed_tokens split by vocabulary rows (Megatron's VocabParallelEmbedding): each tensor-parallel rank holds
    vocab_size / tp_size rows and embeds the tokens in its range (zeros for the others); an AllReduce sums them. It
    runs once per text, and keeps the 151,936-row table (1.2 GB in bf16 at the published size) off every rank's
    copy."""

    def __init__(self, vocab_size: int, dim: int, comm: Communicator):
        super().__init__()
        self.comm, self.vocab_size = comm, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size // comm.tp_size, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.comm.tp_rank * rows
        inside = (local >= 0) & (local < rows)
        embedded = F.embedding(local.clamp(0, rows - 1), self.weight)
        return self.comm.tp_all_reduce(torch.where(inside[..., None], embedded, torch.zeros_like(embedded)))

    def shard_specs(self) -> dict[str, tuple[int, list[int]]]:
        return {"weight": (0, [self.vocab_size])}


class ReplicatedLinear(ParallelLinear):
    """A linear layer every tensor-parallel rank holds whole (no shard specs: the build copies it): the key/value
    projections where the key/value heads do not divide by tp_size."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fp8: bool):
        super().__init__(in_features, out_features, out_features if bias else None, fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local_linear(x, self.bias)


class KeyValueHeads:
    """Which key/value heads a tensor-parallel rank uses: its query heads [tp_rank * q, (tp_rank + 1) * q) use key/value
    heads h // group. Where the key/value heads divide by tp_size the projections are split like the queries'; where
    they do not, each rank's query heads share one key/value head (check_plan refuses other splits), the projections
    are replicated and the rank keeps its head."""

    def __init__(self, heads: int, kv_heads: int, comm: Communicator):
        self.split = kv_heads % comm.tp_size == 0
        self.total = kv_heads
        self.local = kv_heads // comm.tp_size if self.split else 1
        self.first = None if self.split else comm.tp_rank * (heads // comm.tp_size) // (heads // kv_heads)

    def projection(self, in_features: int, head_dim: int, comm: Communicator, bias: bool,
                   fp8: bool) -> ColumnParallelLinear | ReplicatedLinear:
        if self.split:
            return ColumnParallelLinear(in_features, self.total * head_dim, comm, bias=bias, fp8=fp8)
        return ReplicatedLinear(in_features, self.total * head_dim, bias, fp8)

    def mine(self, heads: torch.Tensor) -> torch.Tensor:
        """This rank's key/value heads of a projection's output [..., heads, head_dim]."""
        return heads if self.split else heads[..., self.first:self.first + 1, :]


class GatedMLP(nn.Module):
    """diffusers' Cosmos3VLTextMLP and its residual: x plus the MLP of x's RMS norm (the norm's weight is the
    caller's: the decoder layer holds it). silu (Qwen3): down(silu(gate(x)) * up(x)), gate and up in one GEMM after
    fuse_projections; relu2 (Nemotron): down(relu(up(x))^2). gate and up split by columns, down by rows (one
    AllReduce)."""

    def __init__(self, config: dict, comm: Communicator, fp8: bool):
        super().__init__()
        hidden, intermediate = config["hidden_size"], config["intermediate_size"]
        self.gated = config["hidden_act"] == "silu"
        self.eps, self.nemotron = config["rms_norm_eps"], not self.gated
        if self.gated:
            self.gate_proj = ColumnParallelLinear(hidden, intermediate, comm, bias=False, fp8=fp8)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, comm, bias=False, fp8=fp8)
        self.down_proj = RowParallelLinear(intermediate, hidden, comm, bias=False, fp8=fp8)
        self.gate_up: ColumnParallelLinear | None = None

    def fuse_projections(self) -> None:
        if self.gated:
            self.gate_up = fuse_columns({"gate_proj": self.gate_proj, "up_proj": self.up_proj})
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        normed = rms_norm(x, norm_weight, self.eps, self.nemotron)
        if self.gated:
            gate, up = self.gate_up(normed).chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = torch.relu(self.up_proj(normed)).square()
        return x + self.down_proj(hidden)
