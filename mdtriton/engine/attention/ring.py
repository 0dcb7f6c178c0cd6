"""Ring attention: key/value blocks travel around the context-parallel ring while each rank attends its
queries to the block it holds, merging blocks by their log-sum-exp (online softmax). Nobody holds the
whole K/V, and each block's transfer runs while the previous one is being attended."""

from __future__ import annotations

import torch

from mdtriton.engine.attention.local import attention_with_lse
from mdtriton.engine.comm import Communicator


@torch.compiler.disable
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int) -> torch.Tensor:
    """Local queries over every rank's keys and values, one block per ring step."""
    block_len = k.shape[2]
    kv = torch.stack((k, v))  # one contiguous buffer to send: [2, B, H, block_len, D]
    out = lse = None
    for step in range(comm.cp_size):
        last = step == comm.cp_size - 1
        if not last:
            received, works = comm.cp_ring_shift([kv])
        # At step s this rank holds the block of the rank s places before it in the ring.
        source = (comm.cp_rank - step) % comm.cp_size
        keys = min(max(valid_len - source * block_len, 0), block_len)
        if keys:
            block_out, block_lse = attention_with_lse(q, kv[0, :, :, :keys], kv[1, :, :, :keys])
            out, lse = merge(out, lse, block_out, block_lse)
        if not last:
            comm.wait(works)
            kv = received[0]
    return out.to(q.dtype)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine the attention over the keys so far (out, lse) with one more block's, in float32."""
    if out is None:
        return block_out.float(), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    weight, block_weight = torch.exp(lse - new_lse).unsqueeze(-1), torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out * weight + block_out.float() * block_weight, new_lse
