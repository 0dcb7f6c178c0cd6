"""The elastic job hub's policy (backend/job_scheduler.py) on a world of 4 ranks: a job alone takes every free rank,
jobs that queue take one rank each, first come first served, and a job past its deadline is dropped."""

from __future__ import annotations

from mdtriton.backend.job_scheduler import GroupScheduler
from mdtriton.backend.messages import Submit
from mdtriton.engine.plan import ParallelPlan

PLAN = ParallelPlan(cp_size=4, cp_method="ulysses", elastic=True)


def scheduler() -> GroupScheduler:
    return GroupScheduler({size: PLAN.group_partition(size) for size in PLAN.group_sizes()})


def job(name: str, deadline: float | None = None) -> Submit:
    return Submit(name, 0, [], deadline)


def starts(schedule: GroupScheduler) -> list[tuple[str, list[int]]]:
    started = []
    while (next_start := schedule.start_next()) is not None:
        started.append((next_start[0].job, next_start[1]))
    return started


def test_a_job_alone_takes_the_largest_free_group_and_queued_jobs_one_rank_each():
    schedule = scheduler()
    schedule.submit(job("a"))
    assert starts(schedule) == [("a", [0, 1, 2, 3])]
    for name in "bcde":
        schedule.submit(job(name))
    assert starts(schedule) == []  # every rank busy
    assert [schedule.finished("a", rank) for rank in range(4)] == [False, False, False, True]
    # b, c, d each have others behind them: one rank each; e, alone at last, takes the largest group left (one rank).
    assert starts(schedule) == [("b", [0]), ("c", [1]), ("d", [2]), ("e", [3])]
    schedule.finished("c", 1)
    schedule.submit(job("f"))
    assert starts(schedule) == [("f", [1])]
    for name, rank in (("d", 2), ("e", 3)):
        schedule.finished(name, rank)
    schedule.submit(job("g"))
    assert starts(schedule) == [("g", [2, 3])]  # alone: the free pair


def test_first_come_first_served_and_late_or_withdrawn_jobs_leave_the_queue():
    schedule = scheduler()
    schedule.submit(job("a"))
    starts(schedule)
    schedule.submit(job("late", deadline=5.0))
    schedule.submit(job("b", deadline=50.0))
    schedule.submit(job("c"))
    schedule.submit(job("d"))
    assert schedule.next_deadline() == 5.0
    assert [s.job for s in schedule.expired(now=10.0)] == ["late"]
    assert schedule.withdraw("c").job == "c" and schedule.withdraw("a").group == [0, 1, 2, 3]
    for rank in (2, 3):  # a's last ranks have not finished: nothing starts on them
        schedule.finished("a", rank)
    assert starts(schedule) == [("b", [2]), ("d", [3])]  # b first (d behind it: the smallest group), then d
