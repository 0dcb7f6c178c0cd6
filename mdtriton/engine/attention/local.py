"""Attention over keys held on this rank: the plain case and the building block of the CP methods."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mdtriton.engine.comm import Communicator

# Flash attention returns the log-sum-exp the ring method needs; it takes these dtypes on CUDA.
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int) -> torch.Tensor:
    """Attention when this rank holds the whole sequence (cp_size 1); keys from valid_len on are dropped."""
    return F.scaled_dot_product_attention(q, k[:, :, :valid_len], v[:, :, :valid_len])


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [B, H, Sq, D] and the log-sum-exp of each query's scaled scores [B, H, Sq] (float32).

    On CUDA in fp16/bf16 this is one flash-attention kernel; elsewhere it is computed explicitly in float32.
    """
    if q.device.type == "cuda" and q.dtype in FLASH_DTYPES:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = scores.logsumexp(dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse
