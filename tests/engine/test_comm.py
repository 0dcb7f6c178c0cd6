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
    """Every collective of comm whose group has both ranks (the world's broadcast, and its plan's group's)."""
    collectives = {"broadcast": lambda: comm.broadcast(x, src=0)}
    if comm.tp_size == 2:
        collectives["tp_all_reduce"] = lambda: comm.tp_all_reduce(x)
    if comm.cp_size == 2:
        collectives.update(cp_all_gather=lambda: comm.cp_all_gather(x, 0), cp_all_reduce=lambda: comm.cp_all_reduce(x),
                           cp_all_gather_into=lambda: comm.cp_all_gather_into(torch.empty(2, 4), x))
    if comm.ulysses_size == 2:
        collectives["ulysses_all_to_all"] = lambda: comm.ulysses_all_to_all(torch.empty_like(x), x)
    if comm.ring_size == 2:
        collectives["ring_shift"] = lambda: comm.ring_shift(x, torch.empty_like(x))
    if comm.cfg_size == 2:
        collectives["cfg_all_gather"] = lambda: comm.cfg_all_gather(x)
    return collectives


def _refusals_on_gpu_ranks(rank: int, world_size: int, plan: ParallelPlan) -> dict:
    """Ranks that say they are on GPUs (the collectives run over gloo here: no GPU needed) are handed a host tensor:
    every collective refuses it; then the world still sums a tensor, so nobody entered a collective alone."""
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
    return {"refused": refused, "sum after": float(total)}


@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_a_host_tensor_is_refused_by_gpu_ranks_before_the_collective(plan_name):
    expected = {"tp": 2, "allgather_kv": 4, "cfg": 2, "ulysses": 5, "ring": 5}[plan_name]  # broadcast + the plan's
    for rank, result in enumerate(run_ranks(2, _refusals_on_gpu_ranks, PLANS[plan_name])):
        assert result["sum after"] == 2.0
        assert len(result["refused"]) == expected
        for name, message in result["refused"].items():
            assert message is not None, f"{name} sent a host tensor from a GPU rank"
            assert f"rank {rank}" in message and "on cpu" in message and f"cuda:{rank} only" in message


def test_tensors_on_the_rank_device_pass_the_contract():
    comm = Communicator(ParallelPlan(cp_size=2), 0, torch.device("cpu"))
    comm.check_device("a test", torch.ones(2), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(CollectiveInputError, match="on meta"):
        comm.check_device("a test", torch.ones(2, device="meta"))
