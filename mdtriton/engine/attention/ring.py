"""Ring attention: key/value blocks travel round the ring, both ways, while each rank attends its queries to the
blocks it holds. Each step starts the next transfer (one batched send/receive: the block that came forwards passed on
forwards, the one that came backwards passed on backwards, each into one of two sets of buffers, used in turn; the
rank's own block is sent both ways from where it is) before attending what it holds, so the transfer runs under that
attention, which leaves NCCL its multiprocessors (RING_NCCL_SMS). Both ways, a ring of N ranks takes N // 2 transfer
steps instead of N - 1, and (with one sample) the two blocks a step brings are attended by one call over both: on 4
ranks three calls instead of four, two transfers instead of three, the second of half a block each way. The calls'
outputs, each written where the merge reads it, are combined once, at the end, by their log-sum-exps
(attention.merge).

With cp_method ring the ring is the whole context-parallel group; with ulysses_ring each ring passes the blocks of
its Ulysses groups (attention.ulysses_ring).
"""

from __future__ import annotations

import torch

from mdtriton.engine.attention.local import RING_NCCL_SMS, Beside, attention_with_lse, beside_transfer
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
    ranks, position = comm.ring_size, comm.ring_rank
    batch, heads, queries, dim = q.shape
    kv_heads, length = k.shape[1:3]
    # Blocks travel both ways round the ring: forwards, those of the ranks before this one (position - 1, - 2, ...),
    # backwards those after it (position + 1, ...); a step's transfer brings one of each.
    steps, backward_steps = ranks // 2, (ranks - 1) // 2
    directions = 2 if backward_steps else 1
    # Blocks as [B, L, key/value heads, D]: this rank's own is sent from where it is (no copy where k and v are views
    # of such memory, as the blocks make them); those that arrive land in buffers[set, k or v, direction], the sets
    # used in turn. With one sample a set's two directions are one block of keys (or values) of 2 L tokens.
    own = [x.transpose(1, 2).contiguous() for x in (k, v)]
    buffers = k.new_empty(min(steps, 2), 2, directions, batch, length, kv_heads, dim)
    outputs = q.new_empty(ranks, batch, queries, heads, dim)
    lses = q.new_empty(ranks, batch, queries, heads, dtype=torch.float32)
    attended = 0

    def attend(keys: torch.Tensor, values: torch.Tensor, count: int, in_flight: bool) -> None:
        # The output is written where the merge reads it; the kernel leaves NCCL its multiprocessors while the next
        # blocks are in flight.
        nonlocal attended
        lse = attention_with_lse(q, keys[:, :count].transpose(1, 2), values[:, :count].transpose(1, 2),
                                 out=outputs[attended], nccl_sms=RING_NCCL_SMS if in_flight else 0)[1]
        lses[attended].copy_(lse.transpose(1, 2))
        attended += 1

    def keys_of(source: int) -> int:
        return min(max(valid_len - source * length, 0), length)

    # In a ring of an even number of ranks (over 2) both neighbours hold the block that comes last (that of
    # position + ranks // 2) at the last transfer: half of it comes each way, the first half of its memory forwards,
    # the second backwards, into one buffer.
    meets = ranks % 2 == 0 and ranks > 2
    held_forward = held_backward = own
    for step in range(steps + 1):
        in_flight = step < steps
        if in_flight:
            arriving = buffers[step % 2]
            brings_back = step + 1 <= backward_steps
            if meets and step == steps - 1:
                halves = [x.view(2, -1) for x in arriving[:, 0].unbind(0)]
                transfer = comm.ring_shift([x.view(2, -1)[0] for x in held_forward], [x[0] for x in halves],
                                           [x.view(2, -1)[1] for x in held_backward], [x[1] for x in halves])
            else:
                transfer = comm.ring_shift(held_forward, arriving[:, 0].unbind(0),
                                           held_backward if brings_back else (),
                                           arriving[:, 1].unbind(0) if brings_back else ())
        if step == 0:
            beside_result = beside_transfer(beside, q.device, RING_NCCL_SMS)
            if keys_of(position):
                attend(*own, keys_of(position), in_flight)
        else:
            forward_keys = keys_of((position - step) % ranks)
            backward_keys = keys_of((position + step) % ranks) if step <= backward_steps else 0
            held = buffers[(step - 1) % 2]
            if backward_keys and batch == 1 and forward_keys == length:
                # Both blocks in one call: the forward block's keys, then the backward one's, in one piece of memory.
                joined = [x.view(1, directions * length, kv_heads, dim) for x in held]
                attend(*joined, length + backward_keys, in_flight)
            else:
                if forward_keys:
                    attend(*held[:, 0], forward_keys, in_flight)
                if backward_keys:
                    attend(*held[:, 1], backward_keys, in_flight)
        if in_flight:
            transfer.wait()
            held_forward = arriving[:, 0].unbind(0)
            held_backward = arriving[:, 1].unbind(0) if brings_back else ()
    out = merge_blocks(outputs[:attended], lses[:attended]).transpose(1, 2)
    if beside is None:
        return out
    return out, beside_result
