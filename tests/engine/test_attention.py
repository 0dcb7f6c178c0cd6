"""Each context-parallel attention method against plain attention over the unpadded sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mdtriton.engine.attention import (CP_ATTENTION, PACKED_CP_ATTENTION, attention_for, head_exchange_for, local,
                                       packed_attention_for)
from mdtriton.engine.attention.ulysses import heads_by_rank, pack_heads
from mdtriton.engine.attention.merge import merge_blocks
from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from tests.distributed import run_ranks
from tests.engine.flux_cases import max_relative_error

BATCH, HEADS, LOCAL_LEN, HEAD_DIM = 2, 4, 5, 8


def qkv_with_loud_padding(world_size: int, valid_len: int, seed: int, kv_heads: int = HEADS,
                          batch: int = BATCH) -> tuple[torch.Tensor, ...]:
    """Random q [B, H, world_size * LOCAL_LEN, D], k and v with kv_heads heads; keys and values past valid_len are
    huge, so any leak of padding into a real token's output would be plain to see."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, HEADS, world_size * LOCAL_LEN, HEAD_DIM)
    q = torch.randn(shape, generator=generator)
    k, v = (torch.randn((batch, kv_heads, *shape[2:]), generator=generator) for _ in range(2))
    k[:, :, valid_len:] *= 30
    v[:, :, valid_len:] *= 1000
    return q, k, v


def expected_output(q, k, v, valid_len: int) -> torch.Tensor:
    """Plain attention over the real tokens; grouped key/value heads each serve q's heads in turn."""
    groups = q.shape[1] // k.shape[1]
    k, v = (part.repeat_interleave(groups, dim=1)[:, :, :valid_len] for part in (k, v))
    return F.scaled_dot_product_attention(q[:, :, :valid_len], k, v)


def plans(world_size: int) -> dict[str, ParallelPlan]:
    """Every context-parallel method on world_size ranks (ulysses_ring where the world splits into 2 x 2 or more)."""
    methods = {name: ParallelPlan(cp_size=world_size, cp_method=name) for name in ("allgather_kv", "ring", "ulysses")}
    if world_size % 2 == 0 and world_size >= 4:
        methods["ulysses_ring"] = ParallelPlan(cp_size=world_size, cp_method="ulysses_ring", ulysses_size=2)
    return methods


def run_methods(rank: int, world_size: int, cases: list) -> dict[str, list]:
    """On one rank: every CP method on this rank's slice of every case; outputs as numpy arrays."""
    results = {}
    for name, plan in plans(world_size).items():
        if name == "ulysses" and HEADS % world_size:
            continue
        comm = Communicator(plan, rank, torch.device("cpu"))
        comm.join_groups()
        mine = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
        results[name] = [with_beside(CP_ATTENTION[name], q[:, :, mine], k[:, :, mine], v[:, :, mine], comm,
                                     valid_len).numpy() for q, k, v, valid_len in cases]
        if name in PACKED_CP_ATTENTION:  # q, k and v packed by the caller (FLUX's q/k/v kernel): the same outputs
            for (q, k, v, valid_len), out in zip(cases, results[name]):
                if k.shape[1] == q.shape[1]:
                    send = pack_heads(q[:, :, mine], k[:, :, mine], v[:, :, mine], comm.ulysses_size)
                    packed = with_beside(PACKED_CP_ATTENTION[name], send, None, None, comm, valid_len)
                    assert torch.equal(packed, torch.from_numpy(out)), name
                    # with work after beside's, beside the output's return: its result in place of beside's
                    packed, result = PACKED_CP_ATTENTION[name](send, comm, valid_len, beside=lambda: comm.rank,
                                                               after=lambda rank: ("after", rank))
                    assert result == ("after", comm.rank) and torch.equal(packed, torch.from_numpy(out)), name
                    # sent one at a time (Wan's blocks), in the order they are made: the same outputs
                    exchange = head_exchange_for(comm)
                    for part, x in (("v", v), ("k", k), ("q", q)):
                        exchange.send(part, heads_by_rank(x[:, :, mine].transpose(1, 2), comm.ulysses_size))
                    assert torch.equal(exchange.attention(valid_len), torch.from_numpy(out)), name
    return results


def with_beside(method, q, k, v, comm: Communicator, valid_len: int) -> torch.Tensor:
    """method's output, checked to be the same when given work beside it, whose result it returns with it (a packed
    method takes q, k and v packed, as q; k and v None)."""
    inputs = (q,) if k is None else (q, k, v)
    out = method(*inputs, comm, valid_len)
    out_beside, result = method(*inputs, comm, valid_len, beside=lambda: ("beside", comm.rank))
    assert result == ("beside", comm.rank)
    assert torch.equal(out_beside, out)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_methods_match_plain_attention(world_size):
    """Every method on 2, 3 and 4 ranks (Ulysses x Ring on 4), with no padding, padding inside the last rank's slice,
    and whole ranks of padding; with as many key/value heads as query heads and with fewer (grouped-query attention:
    on 4 ranks Ulysses has fewer key/value heads than ranks); with two samples and one (the ring then attends the two
    blocks a step brings, one from each way round, in one call where the first is whole)."""
    valid_lens = [world_size * LOCAL_LEN, world_size * LOCAL_LEN - 3, LOCAL_LEN - 1]
    cases = [(*qkv_with_loud_padding(world_size, n, seed, kv_heads, batch), n)
             for kv_heads, batch in ((HEADS, BATCH), (2, BATCH), (2, 1)) for seed, n in enumerate(valid_lens)]
    per_rank = run_ranks(world_size, run_methods, cases)
    expected_methods = {name for name in plans(world_size) if not (name == "ulysses" and HEADS % world_size)}
    assert set(per_rank[0]) == expected_methods
    for name in expected_methods:
        for (q, k, v, valid_len), *outputs in zip(cases, *(results[name] for results in per_rank)):
            got = torch.cat([torch.from_numpy(out) for out in outputs], dim=2)[:, :, :valid_len]
            error = max_relative_error(got, expected_output(q, k, v, valid_len))
            assert error < 1e-5, (f"{name} on {world_size} ranks, {k.shape[1]} key/value heads, valid_len {valid_len}:"
                                  f" error {error:.2e}")


@pytest.mark.parametrize("name", sorted(CP_ATTENTION))
def test_methods_on_one_rank_are_plain_attention(name):
    q, k, v = qkv_with_loud_padding(1, 3, seed=7)
    got = with_beside(CP_ATTENTION[name], q, k, v, Communicator.single(), 3)
    assert max_relative_error(got[:, :, :3], expected_output(q, k, v, 3)) < 1e-5
    assert attention_for(ParallelPlan(cp_method=name)) is local.attention
    assert packed_attention_for(ParallelPlan(cp_method=name)) is None
    plan = ParallelPlan(cp_size=4, cp_method=name, ulysses_size=2 if name == "ulysses_ring" else 1)
    assert packed_attention_for(plan) is PACKED_CP_ATTENTION.get(name)
    assert head_exchange_for(Communicator.single()) is None
    assert (head_exchange_for(Communicator(plan, 0, torch.device("cpu"))) is None) == (name not in PACKED_CP_ATTENTION)


@pytest.mark.parametrize("kv_heads", [HEADS, 1])
def test_attention_with_lse_gives_output_and_log_sum_exp(kv_heads):
    q, k, v = qkv_with_loud_padding(1, LOCAL_LEN, seed=3, kv_heads=kv_heads)
    out, lse = local.attention_with_lse(q, k, v)
    scores = q @ k.repeat_interleave(HEADS // kv_heads, dim=1).transpose(-1, -2) / HEAD_DIM ** 0.5
    assert max_relative_error(out, expected_output(q, k, v, LOCAL_LEN)) < 1e-5
    assert max_relative_error(lse, scores.logsumexp(dim=-1)) < 1e-6


@pytest.mark.parametrize("blocks", [1, 3])
def test_merged_blocks_are_attention_over_all_keys(blocks):
    """merge_blocks of each key block's output and log-sum-exp (one block of padding only: lse -inf) equals
    attention over every key at once."""
    q, k, v = qkv_with_loud_padding(1, LOCAL_LEN * blocks, seed=5)
    k, v = (torch.cat([part] * blocks, dim=2) + torch.randn(part.shape[0], HEADS, LOCAL_LEN * blocks, HEAD_DIM)
            for part in (k, v))
    parts = [local.attention_with_lse(q, k[:, :, i::blocks], v[:, :, i::blocks]) for i in range(blocks)]
    outputs = torch.stack([out.transpose(1, 2) for out, _ in parts] + [torch.zeros_like(parts[0][0].transpose(1, 2))])
    lses = torch.stack([lse.transpose(1, 2) for _, lse in parts] + [torch.full_like(parts[0][1].transpose(1, 2),
                                                                                     float("-inf"))])
    merged = merge_blocks(outputs, lses).transpose(1, 2)
    assert max_relative_error(merged, F.scaled_dot_product_attention(q, k, v)) < 1e-5


@pytest.mark.gpu
def test_the_merge_kernel_equals_the_pytorch_merge():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    generator = torch.Generator().manual_seed(2)
    outputs = torch.randn(4, 2, 77, 6, 128, generator=generator).to(torch.bfloat16)
    lses = torch.randn(4, 2, 77, 6, generator=generator) * 5
    lses[2, :, :10] = float("-inf")
    expected = merge_blocks(outputs, lses).float()
    got = merge_blocks(outputs.cuda(), lses.cuda()).float().cpu()
    assert max_relative_error(got, expected) < 1e-2  # both round the float32 sum to bf16
