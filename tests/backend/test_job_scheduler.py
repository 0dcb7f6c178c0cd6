"""The elastic job hub's policy (backend/job_scheduler.py) on a world of 4 ranks: a job alone takes every free rank,
or, by a table of forward times, the largest group that makes it faster by its size; jobs that queue take one rank
each, first come first served, and a job past its deadline is dropped."""

from __future__ import annotations

from mdtriton.backend.job_scheduler import GroupScheduler, group_size_for
from mdtriton.backend.messages import Submit
from mdtriton.engine.group_times import GroupTimes
from mdtriton.engine.plan import ParallelPlan

PLAN = ParallelPlan(cp_size=4, cp_method="ulysses", elastic=True)


# Seconds of a forward at 500 and 4,000 tokens by group size: at 500 tokens a pair gains 5% over one rank and four
# ranks 25%; at 4,000 a pair halves the time, four ranks only 8% less than the pair.
TIMES = GroupTimes((500, 4000), {1: (0.100, 1.000), 2: (0.095, 0.500), 4: (0.080, 0.460)})


def scheduler(times: GroupTimes | None = None, min_speedup: float = 1.1) -> GroupScheduler:
    return GroupScheduler({size: PLAN.group_partition(size) for size in PLAN.group_sizes()}, times, min_speedup)


def job(name: str, deadline: float | None = None, tokens: int | None = None) -> Submit:
    return Submit(name, 0, [], deadline, tokens=tokens)


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


def test_a_job_alone_takes_the_largest_group_that_makes_it_faster_by_its_size():
    assert abs(TIMES.seconds_at(2, 2250) - 0.2975) < 1e-12 and TIMES.seconds_at(1, 100) == 0.100  # a line; the nearer point outside
    # Small: the pair is 5% faster (not taken), four ranks 25% faster than one (taken: each size against the best so far).
    assert [group_size_for(tokens, TIMES, 1.1) for tokens in (100, 500, 4000, 9000)] == [4, 4, 2, 2]
    assert group_size_for(500, TIMES, 1.3) == 1 and group_size_for(4000, TIMES, 1.0) == 4
    schedule = scheduler(TIMES)
    schedule.submit(job("large", tokens=4000))
    assert starts(schedule) == [("large", [0, 1])]  # four ranks would save 8%: two stay free
    schedule.submit(job("next", tokens=4000))
    assert starts(schedule) == [("next", [2, 3])]
    schedule.finished("large", 0)
    schedule.finished("large", 1)
    schedule.submit(job("unsized"))  # the engine cannot tell its size: the largest free group
    assert starts(schedule) == [("unsized", [0, 1])]
    schedule = scheduler(TIMES, min_speedup=1.3)
    schedule.submit(job("small", tokens=500))
    assert starts(schedule) == [("small", [0])]
    schedule.submit(job("other", tokens=500))
    schedule.submit(job("third", tokens=500))
    assert starts(schedule) == [("other", [1]), ("third", [2])]  # "third", alone at last, gains too little from [2, 3]
    schedule = scheduler(TIMES, min_speedup=0)  # 0: always the largest free group
    schedule.submit(job("small", tokens=500))
    assert starts(schedule) == [("small", [0, 1, 2, 3])]
