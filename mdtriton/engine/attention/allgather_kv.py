"""AllGather-KV context parallelism: gather every rank's keys and values, attend local queries over all.

The keys and values are gathered all at once, each into a buffer of its own in which, with one sample, the ranks'
slices are the whole sequence's keys (or values) in token order: attended where they landed, with no copy. Gathering
them in head groups, each group's attention running while the next group's are in flight, was no faster on 4 H200s
(attention.ulysses).
"""

from __future__ import annotations

import torch

from mdtriton.engine.attention.local import NCCL_SMS, Beside, beside_transfer, plain_attention
from mdtriton.engine.comm import Communicator


@torch._disable_dynamo
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int,
              beside: Beside = None):
    """Local queries over the whole sequence's keys and values (padding keys cut off; k and v may have fewer heads
    than q: they are gathered as they are); beside runs while they are in flight."""
    batch, kv_heads, length, dim = k.shape
    ranks = comm.cp_size
    # k and v gathered apart, each as [B, S, kv_heads, D] (no copy where they are views of such memory, as the blocks
    # make them); gathered[r]: rank r's. With one sample the ranks' slices are then the whole sequence in place.
    sent = [x.transpose(1, 2).contiguous() for x in (k, v)]
    gathered = [x.new_empty(ranks, *x.shape) for x in sent]
    arrivals = [comm.cp_all_gather_into(out, x) for out, x in zip(gathered, sent)]
    beside_result = beside_transfer(beside, q.device, NCCL_SMS)
    for arrival in arrivals:
        arrival.wait()
    k_all, v_all = (x.transpose(0, 1).reshape(batch, ranks * length, kv_heads, dim)[:, :valid_len].transpose(1, 2)
                    for x in gathered)
    out = plain_attention(q, k_all, v_all)
    return out if beside is None else (out, beside_result)
