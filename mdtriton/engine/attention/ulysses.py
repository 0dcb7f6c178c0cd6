"""DeepSpeed-Ulysses context parallelism: all-to-all from (sequence slice, all heads) to (whole sequence,
a slice of heads), plain attention, and all-to-all back. Needs the local heads to divide by cp_size."""

from __future__ import annotations

import torch

from mdtriton.engine.attention.local import plain_attention
from mdtriton.engine.comm import Communicator


@torch.compiler.disable
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int) -> torch.Tensor:
    """Attention of this rank's sequence slice, computed head-split over the whole sequence."""
    heads = q.shape[1]
    if heads % comm.cp_size:
        raise ValueError(f"ulysses needs the {heads} heads on each rank to divide by cp_size {comm.cp_size}; "
                         "use cp_method allgather_kv or ring")
    # One all-to-all for q, k and v: scatter heads (dim 2 of the stack), gather the sequence (dim 3).
    qkv = comm.cp_all_to_all(torch.stack((q, k, v)), scatter_dim=2, gather_dim=3)
    out = plain_attention(qkv[0], qkv[1, :, :, :valid_len], qkv[2, :, :, :valid_len])
    return comm.cp_all_to_all(out, scatter_dim=2, gather_dim=1)
