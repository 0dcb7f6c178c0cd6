"""The parallel plan's rank layout: tensor parallelism innermost, guidance outermost, every group a partition."""

from __future__ import annotations

import pytest

from mdtriton.engine.plan import ParallelPlan


@pytest.mark.parametrize("plan", [ParallelPlan(tp_size=2, cp_size=3), ParallelPlan(tp_size=2, cp_size=2, cfg_size=2),
                                  ParallelPlan(cp_size=4, cfg_size=2), ParallelPlan(cfg_size=2)])
def test_every_kind_of_group_partitions_the_world_and_agrees_with_the_coordinates(plan):
    for groups, coordinate in ((plan.tp_group_ranks(), plan.tp_rank), (plan.cp_group_ranks(), plan.cp_rank),
                               (plan.cfg_group_ranks(), plan.cfg_rank)):
        assert sorted(rank for group in groups for rank in group) == list(range(plan.world_size))
        for group in groups:
            assert [coordinate(rank) for rank in group] == list(range(len(group)))
    for rank in range(plan.world_size):
        assert plan.rank_of(plan.cfg_rank(rank), plan.cp_rank(rank), plan.tp_rank(rank)) == rank
    assert plan.tp_group_ranks()[0] == list(range(plan.tp_size))  # tensor parallelism innermost


def test_guidance_groups_are_the_outer_halves_and_round_trip_through_a_manifest():
    plan = ParallelPlan(tp_size=2, cp_size=2, cp_method="ring", cfg_size=2)
    assert plan.world_size == 8 and plan.cfg_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert str(plan) == "world 8 = cfg 2 x tp 2 x cp 2 (ring)"
    assert ParallelPlan.from_dict(plan.to_dict()) == plan
    assert ParallelPlan.from_dict({"tp_size": 2, "cp_size": 1, "cp_method": "ring"}).cfg_size == 1  # older manifests
    with pytest.raises(ValueError, match="cfg_size must be 1 or 2"):
        ParallelPlan(cfg_size=3)
