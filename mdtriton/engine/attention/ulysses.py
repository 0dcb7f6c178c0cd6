"""DeepSpeed-Ulysses context parallelism: all-to-all from (sequence slice, all heads) to (whole sequence, a slice of
heads), attention, and all-to-all back. Needs the local query heads to divide by the Ulysses group's size; key/value
heads that do not (grouped-query attention) are repeated for the query heads that use them before the exchange.

Each rank's q, k and v are packed into one send buffer (one copy; none where the block's q/k/v kernel writes them
there: `packed_attention`), so the exchange is a single contiguous all-to-all; with one sample the received heads
are attended where they landed. Blocks that make q, k and v by three GEMMs (Wan's) send each as soon as it is made,
packed by their kernel, while the next GEMM runs (`HeadExchange`, as yunchang's asynchronous Ulysses overlaps the
exchange with the projections). The heads are exchanged all at once: exchanging them in groups, each group's
attention running while the next group's heads are in flight (as yunchang's and xDiT's asynchronous Ulysses do), was
no faster on 4 H200s at any size measured, and more groups were slower (the transfers slow the attention beside
them; docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mdtriton.engine.attention.local import (ALL_TO_ALL_NCCL_SMS, After, Beside, beside_transfer, expand_heads,
                                             plain_attention)
from mdtriton.engine.comm import Communicator

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch._disable_dynamo
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int,
              beside: Beside = None):
    """Attention of this rank's sequence slice, computed head-split over the whole sequence."""
    return exchange_heads(q, k, v, comm, whole_sequence(valid_len), beside)


@torch._disable_dynamo
def packed_attention(send: torch.Tensor, comm: Communicator, valid_len: int, beside: Beside = None,
                     after: After = None):
    """attention() of queries, keys and values that come packed as the exchange sends them (pack_heads' layout, as
    many key/value heads as query heads): FLUX's q/k/v kernel writes them there, which saves the packing copies.
    after: exchange_packed's."""
    return exchange_packed(send, send.shape[3] // 3, comm, whole_sequence(valid_len), beside, after)


def whole_sequence(valid_len: int) -> Attend:
    return lambda q, k, v: attend_whole_sequence(q, k, v, None, valid_len)


def attend_whole_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator | None,
                          valid_len: int) -> torch.Tensor:
    """Plain attention of the received heads over the real tokens of the whole sequence (HeadExchange's attend)."""
    return plain_attention(q, k[:, :, :valid_len], v[:, :, :valid_len])


def pack_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranks: int) -> torch.Tensor:
    """q, k and v [B, H, S, D] (k and v with a number of heads that divides by ranks) as the exchange sends them:
    [ranks, B, S, width, D], send[r] holding what rank r attends: its query heads, then its key heads, then its
    value heads along the head axis."""
    batch, heads, length, dim = q.shape
    q_width, kv_width = heads // ranks, k.shape[1] // ranks
    send = q.new_empty(ranks, batch, length, q_width + 2 * kv_width, dim)
    for x, start, count in ((q, 0, q_width), (k, q_width, kv_width), (v, q_width + kv_width, kv_width)):
        send[..., start:start + count, :].copy_(x.view(batch, ranks, count, length, dim).permute(1, 0, 3, 2, 4))
    return send


def heads_by_rank(heads: torch.Tensor, ranks: int) -> torch.Tensor:
    """One of q, k and v, heads [B, S, H, D], as HeadExchange.send takes it: [ranks, B, S, H / ranks, D]
    (contiguous), rank r's heads at [r]."""
    batch, length, count, dim = heads.shape
    return heads.view(batch, length, ranks, count // ranks, dim).permute(2, 0, 1, 3, 4).contiguous()


def exchange_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, attend: Attend,
                   beside: Beside = None):
    """attend(q, k, v) over the Ulysses group's sequence slices, one slice of the heads per rank: q, k, v
    [B, H, S, D] hold this rank's slice of the sequence (k and v may have fewer heads: grouped-query attention);
    attend gets [B, H / ulysses_size, ulysses_size * S, D] (the group's slices in rank order; k and v with their
    share of the key/value heads) and returns q's shape; the result is this rank's slice again, [B, H, S, D] (a view
    of [B, S, H, D] memory), and with beside (run while the heads are in flight) (that, beside's result)."""
    ranks = comm.ulysses_size
    heads = q.shape[1]
    if heads % ranks:
        raise ValueError(f"ulysses needs the {heads} heads on each rank to divide by its {ranks} ranks; "
                         "use cp_method allgather_kv or ring")
    if k.shape[1] % ranks:
        # Fewer key/value heads than ranks (e.g. Cosmos 3's 8 on 16 ranks): each rank gets a copy of those it uses.
        k, v = expand_heads(q, k, v)
    return exchange_packed(pack_heads(q, k, v, ranks), heads // ranks, comm, attend, beside)


def exchange_packed(send: torch.Tensor, q_width: int, comm: Communicator, attend: Attend, beside: Beside = None,
                    after: After = None):
    """exchange_heads of q, k and v packed in send ([ranks, B, S, width, D], pack_heads' layout, q_width query heads
    per rank, then as many key heads as value heads). after, with beside: a function of beside's result, run while
    the attention's output travels back; its result is returned in place of beside's."""
    kv_width = (send.shape[3] - q_width) // 2
    received = torch.empty_like(send)
    arrival = comm.ulysses_all_to_all(received, send)
    beside_result = beside_transfer(beside, send.device, ALL_TO_ALL_NCCL_SMS)
    arrival.wait()
    whole = whole_heads(received)
    out = attend(whole[:, :q_width], whole[:, q_width:q_width + kv_width], whole[:, q_width + kv_width:])
    if after is None:
        mine = return_heads(out, comm)
    else:
        mine, beside_result = return_heads(out, comm, lambda: after(beside_result))
    return mine if beside is None else (mine, beside_result)


def whole_heads(received: torch.Tensor) -> torch.Tensor:
    """What an exchange received, [ranks, B, S, width, D] (received[r]: rank r's sequence slice of this rank's
    heads), as [B, width, ranks * S, D] (a view with one sample)."""
    ranks, batch, length, width, dim = received.shape
    return received.transpose(0, 1).reshape(batch, ranks * length, width, dim).transpose(1, 2)


def return_heads(out: torch.Tensor, comm: Communicator, beside: Beside = None):
    """The attention output of this rank's heads over the whole sequence, out [B, heads, ranks * S, D], exchanged
    back: this rank's sequence slice of every head, [B, ranks * heads, S, D] (a view of [B, S, H, D] memory); with
    beside (run while it travels), (that, beside's result)."""
    ranks = comm.ulysses_size
    batch, width, whole_length, dim = out.shape
    length = whole_length // ranks
    # [ranks, B, S, width, D]: rank r's sequence slice first
    outputs = out.transpose(1, 2).reshape(batch, ranks, length, width, dim).transpose(0, 1).contiguous()
    returned = torch.empty_like(outputs)  # returned[r]: this rank's sequence slice of rank r's heads
    arrival = comm.ulysses_all_to_all(returned, outputs)
    beside_result = beside_transfer(beside, out.device, ALL_TO_ALL_NCCL_SMS)
    arrival.wait()
    mine = returned.permute(1, 2, 0, 3, 4).reshape(batch, length, ranks * width, dim).transpose(1, 2)
    return mine if beside is None else (mine, beside_result)


class HeadExchange:
    """Ulysses' exchange of q, k and v sent one at a time, each as soon as the block has made it, so that it travels
    while the block makes the next; then the attention over the whole sequence and the exchange back. One per model,
    shared by its blocks (which run one after another): `send` each of q, k and v, packed as pack_heads packs one of
    them ([ranks, B, S, heads / ranks, D]), then `attention`. attend(q, k, v, comm, valid_len) attends the received
    heads over the whole sequence (exchange_heads' attend, with the length of the real tokens)."""

    def __init__(self, comm: Communicator, attend: Callable[..., torch.Tensor]):
        self.comm, self.attend = comm, attend
        self.sent: dict[str, tuple[torch.Tensor, object]] = {}

    @torch._disable_dynamo
    def send(self, part: str, packed: torch.Tensor) -> None:
        """Start sending part ("q", "k" or "v") of this rank's sequence slice, packed."""
        received = torch.empty_like(packed)
        self.sent[part] = received, self.comm.ulysses_all_to_all(received, packed)

    @torch._disable_dynamo
    def attention(self, valid_len: int) -> torch.Tensor:
        """The attention of what was sent, as attention() returns it ([B, H, S, D], a view of [B, S, H, D] memory)."""
        if sorted(self.sent) != ["k", "q", "v"]:
            raise RuntimeError(f"HeadExchange.attention needs q, k and v sent; got {sorted(self.sent)}")
        parts = []
        for part in ("q", "k", "v"):
            received, arrival = self.sent.pop(part)
            arrival.wait()
            parts.append(whole_heads(received))
        return return_heads(self.attend(*parts, self.comm, valid_len), self.comm)
