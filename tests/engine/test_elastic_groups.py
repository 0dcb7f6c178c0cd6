"""An elastic plan's groups on 4 real gloo ranks: one loaded FLUX engine per rank, bound per job to the whole world,
to a pair or to its rank alone; jobs on disjoint groups run at once, each equal to the one-rank engine; the ranks'
table of forward times by group size is the same on every rank."""

from __future__ import annotations

import pytest
import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from tests.distributed import run_ranks
from tests.engine.flux_cases import fan_in_scaled_weights, flux_inputs, max_relative_error, write_engine

# ring passes blocks to its neighbours by global rank; ulysses_ring's groups are all-to-alls and rings both.
PLANS = {"ring": ParallelPlan(cp_size=4, cp_method="ring", elastic=True),
         "ulysses_ring": ParallelPlan(cp_size=4, cp_method="ulysses_ring", ulysses_size=2, elastic=True)}


def test_group_plans_shrink_the_method_to_the_group():
    plan = ParallelPlan(cp_size=4, cp_method="ulysses", elastic=True)
    assert plan.group_sizes() == [1, 2, 4]
    assert plan.group_partition(2) == [[0, 1], [2, 3]] and plan.group_partition(1) == [[0], [1], [2], [3]]
    assert plan.group_plan(2) == ParallelPlan(cp_size=2, cp_method="ulysses") and plan.group_plan(1) == ParallelPlan(
        cp_method="ulysses")
    guided = ParallelPlan(cp_size=2, cp_method="ulysses", cfg_size=2, elastic=True)
    assert guided.group_plan(2) == ParallelPlan(cfg_size=2, cp_method="ulysses")  # guidance kept, cp shrunk
    usp = ParallelPlan(cp_size=8, cp_method="ulysses_ring", ulysses_size=2, elastic=True)
    assert usp.group_plan(4) == ParallelPlan(cp_size=4, cp_method="ulysses_ring", ulysses_size=2)
    assert usp.group_plan(2) == ParallelPlan(cp_size=2, cp_method="ulysses")
    assert ParallelPlan.from_dict(plan.to_dict()) == plan and "elastic" not in ParallelPlan(cp_size=2).to_dict()
    with pytest.raises(ValueError, match=r"tensor parallelism \(--tp 2\)"):
        ParallelPlan(tp_size=2, cp_size=2, elastic=True)
    with pytest.raises(ValueError, match="world of 2, 4, 8"):
        ParallelPlan(cp_size=3, elastic=True)


def _jobs_on_every_group(rank: int, world_size: int, engine_dirs: dict[str, str], cases: list[dict]) -> dict:
    """Per plan: case 0 on the whole world, case 1 + pair index on each pair, case 3 + rank alone: every rank runs the
    job of its group at the same time as the other groups run theirs."""
    results = {}
    for name, engine_dir in engine_dirs.items():
        manifest = Manifest.read(engine_dir)
        comm = Communicator(manifest.plan, rank, torch.device("cpu"))
        comm.join_groups()
        engine = TorchEngine.load(engine_dir, manifest, FLUX, comm)
        world = engine.forward(cases[0])["sample"]
        with comm.bound_to(2):
            pair = engine.forward(cases[1 + rank // 2])["sample"]
        with comm.bound_to(1):
            alone = engine.forward(cases[3 + rank])["sample"]
        assert comm.plan == manifest.plan and comm.members == [0, 1, 2, 3]  # unbound again
        results[name] = (world, pair, alone, engine.measure_group_times(max_tokens=64) if name == "ring" else None)
    return results


def test_jobs_on_disjoint_groups_equal_one_rank(tmp_path):
    config = FLUX.default_config()
    weights = fan_in_scaled_weights(config, seed=2)
    cases = [flux_inputs(config, 5, 10, seed=i) for i in range(7)]
    one_rank = write_engine(tmp_path / "one_rank", config, ParallelPlan(), weights)
    reference = TorchEngine.load(one_rank, Manifest.read(one_rank), FLUX, Communicator.single())
    expected = [reference.forward(inputs)["sample"] for inputs in cases]
    engine_dirs = {name: str(write_engine(tmp_path / name, config, plan, weights)) for name, plan in PLANS.items()}

    per_rank = run_ranks(4, _jobs_on_every_group, engine_dirs, cases)

    for rank, results in enumerate(per_rank):
        for name, (world, pair, alone, times) in results.items():
            if times is not None:  # the ranks' table of forward times: every size, both counts, the same on every rank
                assert times == per_rank[0][name][3] and times.tokens == (8, 64) and sorted(times.seconds) == [1, 2, 4]
                assert all(seconds > 0 for pair_of_times in times.seconds.values() for seconds in pair_of_times)
            for got, case, group in ((world, 0, "world"), (pair, 1 + rank // 2, "pair"), (alone, 3 + rank, "alone")):
                error = max_relative_error(got, expected[case])
                assert error < 1e-5, f"{name}, rank {rank}, on its {group}: error {error:.2e}"
