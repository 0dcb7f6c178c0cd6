"""Conditioning pieces diffusers' transformers share, with its parameter names and math: the sinusoidal timestep
embedding and the two-layer MLP of TimestepEmbedding and PixArtAlphaTextProjection."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def timestep_embedding(timesteps: torch.Tensor, channels: int) -> torch.Tensor:
    """Sinusoidal embedding [B, channels] (cos half first) of timesteps [B], in float32 as diffusers' Timesteps
    (flip_sin_to_cos, no frequency shift)."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    angles = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1)


class MLPEmbedder(nn.Module):
    """linear_1 -> activation (SiLU unless given) -> linear_2: diffusers' TimestepEmbedding and
    PixArtAlphaTextProjection alike."""

    def __init__(self, in_features: int, dim: int, activation=F.silu):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, dim)
        self.linear_2 = nn.Linear(dim, dim)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.activation(self.linear_1(x)))
