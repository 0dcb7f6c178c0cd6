"""AllGather-KV context parallelism: gather every rank's keys and values, attend local queries over all."""

from __future__ import annotations

import torch

from mdtriton.engine.attention.local import plain_attention
from mdtriton.engine.comm import Communicator


@torch.compiler.disable
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int) -> torch.Tensor:
    """Local queries over the whole sequence's keys and values (padding keys cut off)."""
    kv = comm.cp_all_gather(torch.stack((k, v)), dim=3)  # one collective for both: [2, B, H, S_padded, D]
    return plain_attention(q, kv[0, :, :, :valid_len], kv[1, :, :, :valid_len])
