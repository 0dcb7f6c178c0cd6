"""The plans a family's engine is checked on against one rank, on 2 and 4 gloo ranks: each context-parallel method,
tensor parallelism, tp 2 x each method, and Ulysses x Ring."""

from __future__ import annotations

from mdtriton.engine.plan import ParallelPlan

CP_METHODS = ("allgather_kv", "ring", "ulysses")
PLANS = {
    2: [ParallelPlan(cp_size=2, cp_method=m) for m in CP_METHODS] + [ParallelPlan(tp_size=2)],
    4: [ParallelPlan(cp_size=4, cp_method=m) for m in CP_METHODS] + [ParallelPlan(tp_size=4)]
       + [ParallelPlan(tp_size=2, cp_size=2, cp_method=m) for m in CP_METHODS]
       + [ParallelPlan(cp_size=4, cp_method="ulysses_ring", ulysses_size=2)],
}
