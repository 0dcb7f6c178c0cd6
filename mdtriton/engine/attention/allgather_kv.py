"""AllGather-KV context parallelism: gather every rank's keys and values, attend local queries over all.

The keys and values are gathered all at once into one buffer: gathering them in head groups, each group's attention
running while the next group's are in flight, was no faster on 4 H200s (attention.ulysses).
"""

from __future__ import annotations

import torch

from mdtriton.engine.attention.local import Beside, beside_transfer, plain_attention
from mdtriton.engine.comm import Communicator


@torch.compiler.disable
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int,
              beside: Beside = None):
    """Local queries over the whole sequence's keys and values (padding keys cut off; k and v may have fewer heads
    than q: they are gathered as they are); beside runs while they are in flight."""
    batch, kv_heads, length, dim = k.shape
    ranks = comm.cp_size
    # send[i] = k or v (i) as [B, S, kv_heads, D]; gathered[r]: rank r's send.
    send = k.new_empty(2, batch, length, kv_heads, dim)
    for i, x in enumerate((k, v)):
        send[i].copy_(x.transpose(1, 2))
    gathered = k.new_empty(ranks, 2, batch, length, kv_heads, dim)
    arrival = comm.cp_all_gather_into(gathered, send)
    beside_result = beside_transfer(beside, q.device)
    arrival.wait()
    kv = gathered.permute(1, 2, 0, 3, 4, 5).reshape(2, batch, ranks * length, kv_heads, dim)[:, :, :valid_len]
    out = plain_attention(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2))
    return out if beside is None else (out, beside_result)
