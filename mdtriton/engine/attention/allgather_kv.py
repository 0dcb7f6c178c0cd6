"""AllGather-KV context parallelism: gather every rank's keys and values, attend local queries over all.

The gather runs in head groups (as Ulysses' exchange does, attention.ulysses): every group's all-gather is started
at once into one preallocated buffer, and each group's attention runs as soon as its keys and values have arrived,
while the next group's are still in flight.
"""

from __future__ import annotations

import torch

from mdtriton.engine.attention.local import Beside, beside_transfer, plain_attention
from mdtriton.engine.attention.ulysses import head_groups
from mdtriton.engine.comm import Communicator


@torch.compiler.disable
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int,
              beside: Beside = None):
    """Local queries over the whole sequence's keys and values (padding keys cut off; k and v may have fewer heads
    than q: they are gathered as they are); beside runs while the first group is in flight."""
    batch, kv_heads, length, dim = k.shape
    heads, ranks = q.shape[1], comm.cp_size
    groups = head_groups(batch * q.shape[2], heads, kv_heads)
    q_width, kv_width = heads // groups, kv_heads // groups
    # send[g, i] = head group g of k or v (i), [B, S, kv_width, D]; gathered[g, r]: rank r's send[g].
    send = k.new_empty(groups, 2, batch, length, kv_width, dim)
    for i, x in enumerate((k, v)):
        send[:, i].copy_(x.view(batch, groups, kv_width, length, dim).permute(1, 0, 3, 2, 4))
    gathered = k.new_empty(groups, ranks, 2, batch, length, kv_width, dim)
    arrivals = [comm.cp_all_gather_into(gathered[g], send[g]) for g in range(groups)]
    beside_result = beside_transfer(beside, q.device)
    out = q.new_empty(batch, length, heads, dim)
    for g in range(groups):
        arrivals[g].wait()
        kv = gathered[g].permute(1, 2, 0, 3, 4, 5).reshape(2, batch, ranks * length, kv_width, dim)[:, :, :valid_len]
        query_heads = slice(g * q_width, (g + 1) * q_width)
        out[:, :, query_heads] = plain_attention(q[:, query_heads], kv[0].transpose(1, 2),
                                                 kv[1].transpose(1, 2)).transpose(1, 2)
    out = out.transpose(1, 2)
    return out if beside is None else (out, beside_result)
