"""Ring attention: key/value blocks travel around the ring while each rank attends its queries to the block it
holds; nobody holds more than three blocks (its own and two buffers). Each step starts the next block's transfer (one
batched send/receive into one of two buffers, used in turn; the rank's own block is sent from where it is) before
attending the block it holds, so the transfer runs under that attention, which leaves NCCL its multiprocessors; the
steps' outputs, each written where the merge reads it, are combined once, at the end, by their log-sum-exps
(attention.merge).

With cp_method ring the ring is the whole context-parallel group; with ulysses_ring each ring passes the blocks of
its Ulysses groups (attention.ulysses_ring).
"""

from __future__ import annotations

import torch

from mdtriton.engine.attention.local import NCCL_SMS, Beside, attention_with_lse, beside_transfer
from mdtriton.engine.attention.merge import merge_blocks
from mdtriton.engine.comm import Communicator


@torch._disable_dynamo
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int,
              beside: Beside = None):
    """Local queries over every rank's keys and values, one block per ring step; beside runs while the first
    step's transfer is in flight."""
    return ring_attention(q, k, v, comm, valid_len, beside)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int,
                   beside: Beside = None):
    """q [B, H, Sq, D] over the keys and values of the whole ring: k and v [B, H, L, D] are block `comm.ring_rank` of
    the sequence (positions ring_rank * L onwards); keys from valid_len on are padding. Returns [B, H, Sq, D] (a view
    of [B, Sq, H, D] memory), and with beside (run while the first transfer is in flight) (that, beside's result)."""
    ranks = comm.ring_size
    batch, heads, queries, dim = q.shape
    kv_heads, length = k.shape[1:3]
    # Blocks as [B, L, key/value heads, D]: this rank's own is sent from where it is (no copy where k and v are views
    # of such memory, as the blocks make them); those that arrive land in two buffers, used in turn.
    held = [x.transpose(1, 2).contiguous() for x in (k, v)]
    buffers = k.new_empty(min(ranks - 1, 2), 2, batch, length, kv_heads, dim)  # [buffer, k or v, B, L, heads, D]
    outputs = q.new_empty(ranks, batch, queries, heads, dim)
    lses = q.new_empty(ranks, batch, queries, heads, dtype=torch.float32)
    for step in range(ranks):
        last = step == ranks - 1
        if not last:
            arriving = buffers[step % 2]
            transfer = comm.ring_shift(held, arriving.unbind(0))
        if step == 0:
            beside_result = beside_transfer(beside, q.device, NCCL_SMS)
        # At step s this rank holds the block of the rank s places before it in the ring.
        source = (comm.ring_rank - step) % ranks
        keys = min(max(valid_len - source * length, 0), length)
        if keys:
            # The output is written where the merge reads it; the kernel leaves NCCL its multiprocessors while the
            # next block is in flight.
            lse = attention_with_lse(q, held[0][:, :keys].transpose(1, 2), held[1][:, :keys].transpose(1, 2),
                                     out=outputs[step], beside_a_transfer=not last)[1]
            lses[step].copy_(lse.transpose(1, 2))
        else:  # a block of padding only: no weight in the merge
            outputs[step].zero_()
            lses[step].fill_(float("-inf"))
        if not last:
            transfer.wait()
            held = arriving.unbind(0)
    out = merge_blocks(outputs, lses).transpose(1, 2)
    if beside is None:
        return out
    return out, beside_result
