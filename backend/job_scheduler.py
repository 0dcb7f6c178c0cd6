"""Which group of ranks runs which job of an elastic model, and when: the job hub's policy (backend/job_hub.py).

The groups are the plan's fixed partitions of the world into 1, 2, 4, ... ranks (ParallelPlan.group_partition): two
groups are nested or disjoint. Jobs start in the order they were submitted (first come, first served): the first
job waiting starts as soon as any group is free, so no job is overtaken and none starves. The policy needs no tuning:
- a job with nothing waiting behind it takes the largest free group that makes it faster, by its size: its tokens
  (Submit.tokens, counted by the engine) and the ranks' table of forward times by group size (GroupTimes, which the
  ranks measure together when they meet: mdtriton.engine.group_times). "Faster" means, in `group_size_for`: a group
  is taken over the one chosen so far (starting from one rank) only if the table says it runs a forward of the job's
  tokens at least `min_speedup` times as fast (MIN_SPEEDUP, 1.1: a tenth less time or better). A larger group
  costs its ranks while it runs: a request that would gain less than that (a small image, whose collectives cost
  about what its compute saves) takes fewer ranks, and leaves the others free for the next request, whose wait
  would cost far more than the little it gains; a tenth is also above the noise of a few timed forwards. Without a
  table or a size (an engine that cannot tell: Engine.request_tokens), or with min_speedup 0, the job takes the
  largest free group: the lowest latency the plan gives;
- a job with others waiting behind it takes the smallest free group (one rank), so that the next one can start on
  the ranks left: no rank idles while a job waits. Together, N jobs queued on N ranks run one per rank.
A job past its deadline is dropped when its turn comes (its request has been answered already).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mdtriton.backend.messages import Submit
from mdtriton.engine.group_times import GroupTimes

# How many times as fast a larger group must run a lone job than the group chosen so far (module docstring); a model's
# config.pbtxt may set another (parameter elastic_min_speedup; 0: always the largest free group).
MIN_SPEEDUP = 1.1


def group_size_for(tokens: int, times: GroupTimes, min_speedup: float) -> int:
    """The size of the largest group that makes a lone job of `tokens` tokens faster (module docstring): from one
    rank up, each larger size of the table is taken if it runs the job at least min_speedup times as fast as the size
    taken so far."""
    size = min(times.seconds)
    for larger in sorted(times.seconds):
        if times.seconds_at(larger, tokens) * min_speedup <= times.seconds_at(size, tokens):
            size = larger
    return size


@dataclass
class RunningJob:
    """A job started on a group: the ranks that have not finished it yet."""

    submit: Submit
    group: list[int]
    running_on: set[int]


class GroupScheduler:
    """The queue of an elastic model's jobs and the ranks busy with them (the hub's thread alone uses it)."""

    def __init__(self, partitions: dict[int, list[list[int]]], times: GroupTimes | None = None,
                 min_speedup: float = MIN_SPEEDUP):
        """partitions: every group the jobs may run on, by size (ParallelPlan.group_partition); times: the ranks'
        table of forward times by group size, by which a lone job's group is sized (None: the largest free group);
        min_speedup: what a larger group must gain to be taken (module docstring)."""
        self.partitions = dict(sorted(partitions.items()))
        self.times = times
        self.min_speedup = min_speedup
        self.waiting: deque[Submit] = deque()
        self.running: dict[str, RunningJob] = {}
        self.busy: set[int] = set()

    def submit(self, submit: Submit) -> None:
        self.waiting.append(submit)

    def finished(self, job: str, rank: int) -> bool:
        """A rank has ended a job: it is free again (a rank is given one job at a time). Whether every rank of the
        job's group has ended it now."""
        running = self.running.get(job)
        if running is None or rank not in running.running_on:
            return False
        running.running_on.discard(rank)
        self.busy.discard(rank)
        if running.running_on:
            return False
        del self.running[job]
        return True

    def withdraw(self, job: str) -> Submit | RunningJob | None:
        """A job whose request no longer waits: removed from the queue if it waits there (the Submit), else the
        running job (its group stops it), or None if it is neither."""
        for submit in self.waiting:
            if submit.job == job:
                self.waiting.remove(submit)
                return submit
        return self.running.get(job)

    def expired(self, now: float) -> list[Submit]:
        """Remove and return the waiting jobs past their deadline."""
        late = [submit for submit in self.waiting if submit.deadline is not None and submit.deadline < now]
        for submit in late:
            self.waiting.remove(submit)
        return late

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting job (when to look again for jobs to drop), or None."""
        return min((s.deadline for s in self.waiting if s.deadline is not None), default=None)

    def start_next(self) -> tuple[Submit, list[int]] | None:
        """The first waiting job and the group it starts on now, taken off the queue; None if it must wait (every
        group has a busy rank) or nothing waits."""
        if not self.waiting:
            return None
        free = [group for size, groups in self.partitions.items() for group in groups if self.busy.isdisjoint(group)]
        if not free:
            return None
        submit = self.waiting.popleft()
        if self.waiting:
            group = free[0]  # others wait behind it: the smallest
        else:  # alone: the largest that makes it faster (free groups come smallest first; one rank is always among them)
            size = (max(self.partitions) if submit.tokens is None or self.times is None
                    else group_size_for(submit.tokens, self.times, self.min_speedup))
            largest = max(len(group) for group in free if len(group) <= size)
            group = next(group for group in free if len(group) == largest)
        self.running[submit.job] = RunningJob(submit, group, set(group))
        self.busy.update(group)
        return submit, group
