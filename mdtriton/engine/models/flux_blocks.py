"""FLUX.1's double-stream and single-stream blocks on one rank: heads split across the tensor-parallel
group, tokens split across the context-parallel group (each rank holds a contiguous slice of the joint
[text; image] sequence; the attention function exchanges what the other ranks hold)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.attention import Attention
from mdtriton.engine.comm import Communicator
from mdtriton.engine.layers import ColumnParallelLinear, RowParallelLinear
from mdtriton.engine.models.flux_layers import (AdaLayerNormZero, AdaLayerNormZeroSingle, FeedForward,
                                                apply_rotary, layer_norm)

RMS_EPS = 1e-6
Rope = tuple[torch.Tensor, torch.Tensor]


class FluxAttention(nn.Module):
    """Column-parallel q/k/v projections with per-head RMS norms; in double blocks also the text stream's
    (add_*_proj, norm_added_*) and the row-parallel output projections of both streams."""

    def __init__(self, dim: int, heads: int, head_dim: int, comm: Communicator, joint: bool):
        super().__init__()
        self.head_dim = head_dim
        inner = heads * head_dim
        self.norm_q = nn.RMSNorm(head_dim, eps=RMS_EPS)
        self.norm_k = nn.RMSNorm(head_dim, eps=RMS_EPS)
        self.to_q = ColumnParallelLinear(dim, inner, comm)
        self.to_k = ColumnParallelLinear(dim, inner, comm)
        self.to_v = ColumnParallelLinear(dim, inner, comm)
        if joint:
            self.to_out = nn.ModuleList([RowParallelLinear(inner, dim, comm)])
            self.norm_added_q = nn.RMSNorm(head_dim, eps=RMS_EPS)
            self.norm_added_k = nn.RMSNorm(head_dim, eps=RMS_EPS)
            self.add_q_proj = ColumnParallelLinear(dim, inner, comm)
            self.add_k_proj = ColumnParallelLinear(dim, inner, comm)
            self.add_v_proj = ColumnParallelLinear(dim, inner, comm)
            self.to_add_out = RowParallelLinear(inner, dim, comm)

    def image_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, S, local heads, head_dim] of the image (or, in single blocks, joint) stream."""
        return (self.norm_q(self.heads(self.to_q(x))), self.norm_k(self.heads(self.to_k(x))),
                self.heads(self.to_v(x)))

    def text_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, S, local heads, head_dim] of the text stream of a double block."""
        return (self.norm_added_q(self.heads(self.add_q_proj(x))), self.norm_added_k(self.heads(self.add_k_proj(x))),
                self.heads(self.add_v_proj(x)))

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, self.head_dim))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope, attention: Attention,
           comm: Communicator, valid_len: int) -> torch.Tensor:
    """Rotary-embed q and k [B, S, H, D], run the attention function on [B, H, S, D] views, return [B, S, H*D]."""
    q, k = apply_rotary(q, rope), apply_rotary(k, rope)
    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), comm, valid_len)
    return out.transpose(1, 2).flatten(2)


class FluxTransformerBlock(nn.Module):
    """Double-stream block: text and image keep their own weights and meet in one joint attention."""

    def __init__(self, dim: int, heads: int, head_dim: int, comm: Communicator, attention: Attention):
        super().__init__()
        self.comm = comm
        self.attention = attention
        self.norm1 = AdaLayerNormZero(dim)
        self.norm1_context = AdaLayerNormZero(dim)
        self.attn = FluxAttention(dim, heads, head_dim, comm, joint=True)
        self.ff = FeedForward(dim, comm)
        self.ff_context = FeedForward(dim, comm)

    def forward(self, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, rope: Rope,
                valid_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """image [B, S_img_local, dim] and text [B, S_txt_local, dim] -> both updated; text comes first in the
        joint sequence, so this rank's text tokens (if any) precede its image tokens."""
        norm_image, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(image, temb)
        norm_text, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(text, temb)
        text_q, text_k, text_v = self.attn.text_qkv(norm_text)
        image_q, image_k, image_v = self.attn.image_qkv(norm_image)
        joint = attend(torch.cat((text_q, image_q), dim=1), torch.cat((text_k, image_k), dim=1),
                       torch.cat((text_v, image_v), dim=1), rope, self.attention, self.comm, valid_len)
        # Contiguous halves: linear fuses its bias into the GEMM only for contiguous input (and would copy anyway).
        text_attn, image_attn = (part.contiguous() for part in joint.split((text.shape[1], image.shape[1]), dim=1))

        image = image + gate[:, None] * self.attn.to_out[0](image_attn)
        image = image + gate_mlp[:, None] * self.ff(layer_norm(image) * (1 + scale_mlp[:, None]) + shift_mlp[:, None])
        text = text + c_gate[:, None] * self.attn.to_add_out(text_attn)
        text = text + c_gate_mlp[:, None] * self.ff_context(layer_norm(text) * (1 + c_scale_mlp[:, None])
                                                            + c_shift_mlp[:, None])
        if text.dtype == torch.float16:
            text = text.clip(-65504, 65504)
        return image, text


class FluxSingleTransformerBlock(nn.Module):
    """Single-stream block over the joint sequence: attention and MLP in parallel, one output projection
    over [attention | MLP] (row-parallel per part, so each rank's share of both lines up)."""

    def __init__(self, dim: int, heads: int, head_dim: int, comm: Communicator, attention: Attention):
        super().__init__()
        self.comm = comm
        self.attention = attention
        mlp_hidden = 4 * dim
        self.norm = AdaLayerNormZeroSingle(dim)
        self.proj_mlp = ColumnParallelLinear(dim, mlp_hidden, comm)
        self.proj_out = RowParallelLinear(heads * head_dim + mlp_hidden, dim, comm,
                                          in_segments=[heads * head_dim, mlp_hidden])
        self.attn = FluxAttention(dim, heads, head_dim, comm, joint=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, rope: Rope, valid_len: int) -> torch.Tensor:
        """x [B, S_local, dim] -> updated x."""
        norm_x, gate = self.norm(x, temb)
        mlp = F.gelu(self.proj_mlp(norm_x), approximate="tanh")
        attn = attend(*self.attn.image_qkv(norm_x), rope, self.attention, self.comm, valid_len)
        x = x + gate[:, None] * self.proj_out(torch.cat((attn, mlp), dim=2))
        if x.dtype == torch.float16:
            x = x.clip(-65504, 65504)
        return x
