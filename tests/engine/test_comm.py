"""The Communicator's device contract: a collective refuses a tensor that is not on the rank's device, before the
rank enters it, as NCCL would refuse host memory; gloo alone would send it, so CPU ranks would hide the fault."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mdtriton.engine.comm import CollectiveInputError, Communicator
from mdtriton.engine.plan import ParallelPlan
from tests.distributed import run_ranks

PLANS = {"tp": ParallelPlan(tp_size=2), "allgather_kv": ParallelPlan(cp_size=2), "cfg": ParallelPlan(cfg_size=2),
         "ulysses": ParallelPlan(cp_size=2, cp_method="ulysses"), "ring": ParallelPlan(cp_size=2, cp_method="ring")}


def _collectives_of_two_ranks(comm: Communicator, x: torch.Tensor) -> dict:
    """Every collective of comm whose group has both ranks (the world's, and its plan's group's)."""
    collectives = {"broadcast": lambda: comm.broadcast(x, src=0), "all_reduce": lambda: comm.all_reduce(x),
                   "all_gather": lambda: comm.all_gather(x, 0, [4, 4]),
                   "halo_exchange": lambda: comm.halo_exchange(x, 0, 1)}
    if comm.tp_size == 2:
        collectives["tp_all_reduce"] = lambda: comm.tp_all_reduce(x)
    if comm.cp_size == 2:
        collectives.update(cp_all_gather=lambda: comm.cp_all_gather(x, 0), cp_all_reduce=lambda: comm.cp_all_reduce(x),
                           cp_all_gather_into=lambda: comm.cp_all_gather_into(torch.empty(2, 4), x))
    if comm.ulysses_size == 2:
        collectives["ulysses_all_to_all"] = lambda: comm.ulysses_all_to_all(torch.empty_like(x), x)
    if comm.ring_size == 2:
        collectives["ring_shift"] = lambda: comm.ring_shift([x], [torch.empty_like(x)])
    if comm.cfg_size == 2:
        collectives["cfg_all_gather"] = lambda: comm.cfg_all_gather(x)
    return collectives


def _refusals_on_gpu_ranks(rank: int, world_size: int) -> dict:
    """For each plan, ranks that say they are on GPUs (the collectives run over gloo here: no GPU needed) are handed a
    host tensor: every collective refuses it; then the world still sums a tensor, so nobody entered a collective
    alone."""
    results = {}
    for plan_name, plan in PLANS.items():
        on_gpu = Communicator(plan, rank, torch.device("cuda", rank))
        on_gpu.join_groups()
        refused = {}
        for name, collective in _collectives_of_two_ranks(on_gpu, torch.ones(4)).items():
            try:
                collective()
                refused[name] = None
            except CollectiveInputError as error:
                refused[name] = str(error)
        total = torch.ones(1)
        dist.all_reduce(total)
        results[plan_name] = {"refused": refused, "sum after": float(total)}
    return results


def test_a_host_tensor_is_refused_by_gpu_ranks_before_the_collective():
    # the world's 4 collectives and the plan group's
    expected = {"tp": 5, "allgather_kv": 7, "cfg": 5, "ulysses": 8, "ring": 8}
    for rank, results in enumerate(run_ranks(2, _refusals_on_gpu_ranks)):
        assert sorted(results) == sorted(expected)
        for plan_name, result in results.items():
            assert result["sum after"] == 2.0
            assert len(result["refused"]) == expected[plan_name], plan_name
            for name, message in result["refused"].items():
                assert message is not None, f"{plan_name}: {name} sent a host tensor from a GPU rank"
                assert f"rank {rank}" in message and "on cpu" in message and f"cuda:{rank} only" in message


def _world_collectives(rank: int, world_size: int) -> dict:
    """Rank r holds r + 1 rows of [row index, rank] pairs: bands of uneven sizes, as a split VAE decode's."""
    comm = Communicator(ParallelPlan(cp_size=world_size), rank, torch.device("cpu"))
    comm.join_groups()
    rows = torch.stack((torch.arange(rank + 1.0), torch.full((rank + 1,), float(rank))), dim=1)  # [r + 1, 2]
    return {"halo": comm.halo_exchange(rows.T, dim=1, width=1).T.tolist(),
            "gathered": comm.all_gather(rows.T, dim=1, sizes=[r + 1 for r in range(world_size)]).T.tolist(),
            "sum": comm.all_reduce(rows[:1, 1]).tolist(), "own rows": rows.tolist()}


def test_world_collectives_of_uneven_bands():
    results = run_ranks(3, _world_collectives)
    every_row = [row for result in results for row in result["own rows"]]
    for rank, result in enumerate(results):
        before = results[rank - 1]["own rows"][-1] if rank > 0 else [0.0, 0.0]
        after = results[rank + 1]["own rows"][0] if rank < 2 else [0.0, 0.0]
        assert result["halo"] == [before, *result["own rows"], after]
        assert result["gathered"] == every_row
        assert result["sum"] == [3.0]


def test_tensors_on_the_rank_device_pass_the_contract():
    comm = Communicator(ParallelPlan(cp_size=2), 0, torch.device("cpu"))
    comm.check_device("a test", torch.ones(2), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(CollectiveInputError, match="on meta"):
        comm.check_device("a test", torch.ones(2, device="meta"))
