"""The small pieces of the FLUX.1 transformer, with diffusers' parameter names and math:
timestep/guidance/text conditioning, adaptive layer norms, the feed-forward, and rotary embeddings."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.comm import Communicator
from mdtriton.engine.embeddings import MLPEmbedder, timestep_embedding
from mdtriton.engine.fp8 import Fp8Rows
from mdtriton.engine.fused_activations import modulated_layer_norm, modulated_layer_norm_fp8
from mdtriton.engine.layers import ColumnParallelLinear, RowParallelLinear

TIMESTEP_CHANNELS = 256
ROPE_THETA = 10000


class TimeTextEmbedding(nn.Module):
    """The conditioning vector temb [B, dim] from timestep, guidance (when embedded) and pooled text."""

    def __init__(self, dim: int, pooled_projection_dim: int, guidance_embeds: bool):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(TIMESTEP_CHANNELS, dim)
        self.guidance_embedder = MLPEmbedder(TIMESTEP_CHANNELS, dim) if guidance_embeds else None
        self.text_embedder = MLPEmbedder(pooled_projection_dim, dim)

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None, pooled: torch.Tensor) -> torch.Tensor:
        temb = self.timestep_embedder(timestep_embedding(timestep, TIMESTEP_CHANNELS).to(pooled.dtype))
        if self.guidance_embedder is not None:
            temb = temb + self.guidance_embedder(timestep_embedding(guidance, TIMESTEP_CHANNELS).to(pooled.dtype))
        return temb + self.text_embedder(pooled)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, fp8: bool) -> torch.Tensor | Fp8Rows:
    """LayerNorm(x) (no weights, eps 1e-6, as every FLUX norm) * (1 + scale) + shift, one pass on GPUs; fp8: quantized
    per token for the FP8 GEMMs that read it."""
    return modulated_layer_norm_fp8(x, shift, scale) if fp8 else modulated_layer_norm(x, shift, scale)


def modulation_shares(temb: torch.Tensor, linears: list[nn.Linear], comm: Communicator) -> list[torch.Tensor]:
    """Each linear's output of silu(temb) (the blocks' modulations), as the context-parallel ranks' shares
    [cp_size, B, width] (`joined` makes it [B, out_features]): each rank computes its share of every output, entries
    cp_rank * width onwards, and the group gathers them in one all-gather. Every rank of the group has the same temb;
    computed whole on each, every rank would read every modulation weight (6.5 GB a FLUX.1-dev forward, a third of
    its weights, for a vector per block)."""
    ranks, rank = comm.cp_size, comm.cp_rank
    x = F.silu(temb)
    shares, widths = [], []
    for linear in linears:
        width = -(-linear.out_features // ranks)
        rows = slice(rank * width, (rank + 1) * width)
        share = F.linear(x, linear.weight[rows], linear.bias[rows])
        if share.shape[1] < width:  # the last ranks' shares of a width that ranks does not divide
            share = F.pad(share, (0, width - share.shape[1]))
        shares.append(share)
        widths.append(width)
    gathered = comm.cp_all_gather(torch.cat(shares, dim=1).unsqueeze(0), dim=0)
    return list(gathered.split(widths, dim=2))


def joined(shares: torch.Tensor, features: int) -> torch.Tensor:
    """[B, features] of the ranks' shares [ranks, B, width] (modulation_shares)."""
    return shares.transpose(0, 1).reshape(shares.shape[1], -1)[:, :features]


class AdaLayerNormZero(nn.Module):
    """Norm + shift/scale from the modulation, plus the gate/shift/scale/gate the rest of a double block uses. The
    modulation, its linear of silu(temb), is computed by the block (blocks.modulation_vectors).

    fp8: the normed input is handed on quantized (its readers are the block's FP8 q/k/v GEMMs)."""

    def __init__(self, dim: int, fp8: bool = False):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)
        self.fp8 = fp8

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor | Fp8Rows, ...]:
        """emb: self.linear(silu(temb)), [B, 6 * dim]."""
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        return modulate(x, shift, scale, self.fp8), gate, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nn.Module):
    """Norm + shift/scale from the modulation, and the gate of a single block's output (as AdaLayerNormZero)."""

    def __init__(self, dim: int, fp8: bool = False):
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim)
        self.fp8 = fp8

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        shift, scale, gate = emb.chunk(3, dim=1)
        return modulate(x, shift, scale, self.fp8), gate


class AdaLayerNormContinuous(nn.Module):
    """The final norm: scale and shift (in that order) from temb."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=1)
        return modulate(x, shift, scale, fp8=False)


class GeluProjection(nn.Module):
    """The feed-forward's first layer (column-parallel) and its tanh GELU; named `proj` as in diffusers."""

    def __init__(self, dim: int, hidden: int, comm: Communicator, fp8: bool):
        super().__init__()
        self.proj = ColumnParallelLinear(dim, hidden, comm, fp8=fp8)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor | Fp8Rows:
        return self.proj.forward_gelu(x)


class FeedForward(nn.Module):
    """dim -> 4 dim -> dim, split column/row across the tensor-parallel group."""

    def __init__(self, dim: int, comm: Communicator, fp8: bool):
        super().__init__()
        # Keys "0" and "2" give diffusers' names net.0.proj / net.2 (its net.1 is a parameterless dropout).
        self.net = nn.ModuleDict({"0": GeluProjection(dim, 4 * dim, comm, fp8),
                                  "2": RowParallelLinear(4 * dim, dim, comm, fp8=fp8)})

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.net["2"](self.net["0"](x))


def rotary_embedding(ids: torch.Tensor, axes_dims: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, head_dim] (float32) of each token's position ids [S, n_axes], as diffusers' FluxPosEmbed.

    Computed per call from the ids, so the module holds no buffers and each rank can ask for its own tokens.
    """
    positions = ids.float()
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles = torch.outer(positions[:, axis], freqs)
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)
