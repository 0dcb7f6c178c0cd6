"""DeepSpeed-Ulysses context parallelism: all-to-all from (sequence slice, all heads) to (whole sequence, a slice of
heads), attention, and all-to-all back. Needs the local query heads to divide by the Ulysses group's size; key/value
heads that do not (grouped-query attention) are repeated for the query heads that use them before the exchange.

The exchange runs in head groups, as yunchang's and xDiT's asynchronous Ulysses do: every group's all-to-all is
started at once (they queue on NCCL's stream), and each group's attention runs as soon as its heads have arrived,
while the next group's are still in flight; its output's all-to-all back starts at once too. Each rank's q, k and v
are packed into one send buffer (one copy), so every all-to-all is a single contiguous transfer; with one sample
the received heads are attended where they landed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mdtriton.engine.attention.local import Beside, beside_transfer, expand_heads, plain_attention
from mdtriton.engine.comm import Communicator

# Head groups per exchange. Two let the second group's transfer run under the first group's attention; what stays
# exposed is the first group's arrival and the last group's departure, 1/groups of the transfer each way, so long
# sequences take more groups, as long as each group's attention keeps GROUP_ROWS query rows (about two waves of
# 128-row tiles on an H100's 132 multiprocessors: fewer rows leave it short of filling the GPU), up to
# MAX_HEAD_GROUPS (each group is two more all-to-alls a block). Measured: docs/benchmarks.md, benchmarks/head_groups.py.
MIN_HEAD_GROUPS = 2
GROUP_ROWS = 32_768
MAX_HEAD_GROUPS = 8

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.compiler.disable
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int,
              beside: Beside = None):
    """Attention of this rank's sequence slice, computed head-split over the whole sequence."""
    return exchange_heads(q, k, v, comm, lambda q, k, v: plain_attention(q, k[:, :, :valid_len], v[:, :, :valid_len]),
                          beside)


def head_groups(rows_per_head: int, *heads: int) -> int:
    """How many groups the heads are exchanged in, each attended on its own: the most, up to MAX_HEAD_GROUPS, that
    divide every count of heads (query heads first, then key/value heads) and leave each group's attention
    GROUP_ROWS query rows (rows_per_head: batch x query length); MIN_HEAD_GROUPS where that divides and fewer rows
    are left; else one."""
    dividing = [groups for groups in range(1, MAX_HEAD_GROUPS + 1) if all(count % groups == 0 for count in heads)]
    return max(groups for groups in dividing
               if groups <= MIN_HEAD_GROUPS or heads[0] // groups * rows_per_head >= GROUP_ROWS)


def exchange_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, attend: Attend,
                   beside: Beside = None):
    """attend(q, k, v) over the Ulysses group's sequence slices, one slice of the heads per rank: q, k, v
    [B, H, S, D] hold this rank's slice of the sequence (k and v may have fewer heads: grouped-query attention);
    attend gets [B, H / ulysses_size, ulysses_size * S, D] (the group's slices in rank order; k and v with their
    share of the key/value heads) and returns q's shape; the result is this rank's slice again, [B, H, S, D] (a view
    of [B, S, H, D] memory), and with beside (run while the heads are in flight) (that, beside's result)."""
    ranks = comm.ulysses_size
    batch, heads, length, dim = q.shape
    if heads % ranks:
        raise ValueError(f"ulysses needs the {heads} heads on each rank to divide by its {ranks} ranks; "
                         "use cp_method allgather_kv or ring")
    if k.shape[1] % ranks:
        # Fewer key/value heads than ranks (e.g. Cosmos 3's 8 on 16 ranks): each rank gets a copy of those it uses.
        k, v = expand_heads(q, k, v)
    groups = head_groups(batch * ranks * length, heads // ranks, k.shape[1] // ranks)
    q_width, kv_width = heads // ranks // groups, k.shape[1] // ranks // groups
    width = q_width + 2 * kv_width
    # send[g, r]: what rank r attends of head group g, its query heads, then key heads, then value heads along the
    # head axis: [B, S, width, D].
    send = q.new_empty(groups, ranks, batch, length, width, dim)
    for x, start, count in ((q, 0, q_width), (k, q_width, kv_width), (v, q_width + kv_width, kv_width)):
        send[..., start:start + count, :].copy_(x.view(batch, ranks, groups, count, length, dim).permute(2, 1, 0, 4, 3, 5))
    received = torch.empty_like(send)
    arrivals = [comm.ulysses_all_to_all(received[g], send[g]) for g in range(groups)]
    beside_result = beside_transfer(beside, q.device)
    outputs = q.new_empty(groups, ranks, batch, length, q_width, dim)  # outputs[g, r]: rank r's sequence slice
    returned = torch.empty_like(outputs)
    departures = []
    for g in range(groups):
        arrivals[g].wait()
        # received[g][r]: rank r's sequence slice of this group's heads -> [B, ranks * S, width, D]
        whole = received[g].transpose(0, 1).reshape(batch, ranks * length, width, dim).transpose(1, 2)
        out = attend(whole[:, :q_width], whole[:, q_width:q_width + kv_width], whole[:, q_width + kv_width:])
        outputs[g].copy_(out.transpose(1, 2).reshape(batch, ranks, length, q_width, dim).transpose(0, 1))
        departures.append(comm.ulysses_all_to_all(returned[g], outputs[g]))
    for departure in departures:
        departure.wait()
    # returned[g, r]: heads r * (H / ranks) + g * q_width ... of this rank's slice -> [B, S, H, D]
    mine = returned.permute(2, 3, 1, 0, 4, 5).reshape(batch, length, heads, dim).transpose(1, 2)
    return mine if beside is None else (mine, beside_result)
