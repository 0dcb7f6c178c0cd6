"""Ulysses x Ring (xDiT's USP): inside each Ulysses group of neighbouring ranks an all-to-all turns (sequence
slice, all heads) into (the group's sequence, a slice of heads), as attention.ulysses does; the groups then pass
their key/value blocks around a ring, as attention.ring does; a second all-to-all turns the output back. Context
parallelism is then limited neither to divisors of the head count (Ulysses) nor to the ring's step-by-step
transfers: the all-to-all stays inside an NVLink island, and only the ring crosses between islands.
"""

from __future__ import annotations

import torch

from mdtriton.engine.attention.local import After, Beside
from mdtriton.engine.attention.ring import ring_attention
from mdtriton.engine.attention.ulysses import exchange_heads, exchange_packed
from mdtriton.engine.comm import Communicator


@torch._disable_dynamo
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int,
              beside: Beside = None):
    """Attention of this rank's sequence slice: heads exchanged in its Ulysses group, blocks passed around its ring."""
    return exchange_heads(q, k, v, comm, lambda q, k, v: ring_attention(q, k, v, comm, valid_len), beside)


@torch._disable_dynamo
def packed_attention(send: torch.Tensor, comm: Communicator, valid_len: int, beside: Beside = None,
                     after: After = None):
    """attention() of queries, keys and values packed as the Ulysses exchange sends them (ulysses.packed_attention)."""
    return exchange_packed(send, send.shape[3] // 3, comm, lambda q, k, v: ring_attention(q, k, v, comm, valid_len),
                           beside, after)
