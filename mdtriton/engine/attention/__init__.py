"""Attention over a sequence split across the context-parallel group, one module per method.

Every method has the call signature of `local.attention`:
`attention(q, k, v, comm, valid_len) -> out`, with q, k, v and out of shape
[batch, heads, local_seq, head_dim] holding this rank's contiguous slice of the padded sequence
(cp_rank * local_seq onwards). Keys at global positions >= valid_len are padding and never attended.
k and v may have fewer heads than q, a divisor of them (grouped-query attention, Cosmos 3's): query head h attends
with key/value head h // (q heads / k heads); the methods move the fewer heads and repeat them only for the kernel.
`beside`, if given, is work that does not depend on the attention (a FLUX single block's MLP): a function of no
arguments that each method calls once its first transfer is in flight, so that the work runs on the GPU while the
transfer does; the method then returns (out, beside's result). On one rank beside just runs before the attention.
Each runs eagerly also when called from compiled code (a graph break): its collectives cannot be traced, and its
kernel choice (cuDNN first, local.KERNEL_PRIORITY) is the eager dispatcher's. The methods are marked with
`torch._disable_dynamo`, torch's own form of `torch.compiler.disable` that imports torch's compiler at the first call
rather than at import: a stub (whose family lookup imports these modules) and a CPU rank's worker (which never
compiles) then skip that import, 1.5 s of CPU each (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mdtriton.engine.attention import allgather_kv, local, ring, ulysses, ulysses_ring
from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan

# attention(q, k, v, comm, valid_len, beside=None) -> out, or (out, beside()) with beside.
Attention = Callable[..., torch.Tensor | tuple[torch.Tensor, Any]]
# packed_attention(send, comm, valid_len, beside=None, after=None): the same, of q, k and v packed as Ulysses sends
# them; after, a function of beside's result, runs while the output travels back, and its result replaces beside's.
PackedAttention = Callable[..., torch.Tensor | tuple[torch.Tensor, Any]]

CP_ATTENTION = {
    "allgather_kv": allgather_kv.attention,
    "ring": ring.attention,
    "ulysses": ulysses.attention,
    "ulysses_ring": ulysses_ring.attention,
}


# The methods that exchange heads (Ulysses' all-to-all): what attends the received heads over the whole sequence
# (HeadExchange's attend), and their attention of q, k and v packed as the exchange sends them.
HEAD_EXCHANGING = {
    "ulysses": (ulysses.attend_whole_sequence, ulysses.packed_attention),
    "ulysses_ring": (ring.ring_attention, ulysses_ring.packed_attention),
}
PACKED_CP_ATTENTION = {method: packed for method, (_, packed) in HEAD_EXCHANGING.items()}


def attention_for(plan: ParallelPlan) -> Attention:
    """The attention function for plan: its context-parallel method, or plain attention on one CP rank."""
    if plan.cp_size == 1:
        return local.attention
    return CP_ATTENTION[plan.cp_method]


def head_exchange_for(comm: Communicator) -> ulysses.HeadExchange | None:
    """For the methods that exchange heads (ulysses, ulysses_ring), the exchange that sends q, k and v one at a time
    (ulysses.HeadExchange), for blocks that make them one after another; None for the others, and on one CP rank."""
    if comm.plan.cp_size == 1 or comm.plan.cp_method not in HEAD_EXCHANGING:
        return None
    attend, _ = HEAD_EXCHANGING[comm.plan.cp_method]
    return ulysses.HeadExchange(comm, attend)


def packed_attention_for(plan: ParallelPlan) -> PackedAttention | None:
    """For the methods that exchange heads (ulysses, ulysses_ring), their attention of q, k and v packed as the
    exchange sends them (ulysses.pack_heads' layout: [ulysses_size, B, S, 3 * heads / ulysses_size, D]), for blocks
    that make q, k and v there; None for the others, and on one CP rank."""
    if plan.cp_size == 1:
        return None
    return PACKED_CP_ATTENTION.get(plan.cp_method)
