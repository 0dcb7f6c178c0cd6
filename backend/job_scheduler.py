"""Which group of ranks runs which job of an elastic model, and when: the job hub's policy (backend/job_hub.py).

The groups are the plan's fixed partitions of the world into 1, 2, 4, ... ranks (ParallelPlan.group_partition): two
groups are nested or disjoint. Jobs start in the order they were submitted (first come, first served): the first
job waiting starts as soon as any group is free, so no job is overtaken and none starves. The policy needs no tuning:
- a job with nothing waiting behind it takes the largest free group (a lone request gets every free rank: the lowest
  latency the plan gives);
- a job with others waiting behind it takes the smallest free group (one rank), so that the next one can start on
  the ranks left: no rank idles while a job waits. Together, N jobs queued on N ranks run one per rank.
A job past its deadline is dropped when its turn comes (its request has been answered already).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mdtriton.backend.messages import Submit


@dataclass
class RunningJob:
    """A job started on a group: the ranks that have not finished it yet."""

    submit: Submit
    group: list[int]
    running_on: set[int]


class GroupScheduler:
    """The queue of an elastic model's jobs and the ranks busy with them (the hub's thread alone uses it)."""

    def __init__(self, partitions: dict[int, list[list[int]]]):
        """partitions: every group the jobs may run on, by size (ParallelPlan.group_partition)."""
        self.partitions = dict(sorted(partitions.items()))
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
        group = free[0] if len(self.waiting) > 1 else free[-1]  # smallest while others wait, else the largest
        submit = self.waiting.popleft()
        self.running[submit.job] = RunningJob(submit, group, set(group))
        self.busy.update(group)
        return submit, group
