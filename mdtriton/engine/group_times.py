"""How long an elastic plan's groups of ranks take for one transformer forward, by group size and request size: the
table by which the job hub gives a lone request the largest group that makes it faster (backend/job_scheduler.py).

The ranks measure it together once they have met (the groups' collectives live, communication counted): every group
of each size runs the engine's forward at once on the same seeded request, at a small and a large token count, and
the ranks agree on the slowest rank's time (a world maximum), so every rank holds the same table. Between the two
counts a forward's time is taken as linear in its tokens; outside them, as the nearer count's (a smaller request gains
no more from more ranks than the small count does, a larger one no less than the large count does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mdtriton.engine.comm import Communicator

# The large point: the engine's token limit, at most this many tokens (a FLUX.1-dev forward of 8,192 tokens takes about
# 0.4 s on one H200: the whole table costs a few seconds at load); the small point: an eighth of it.
LARGEST_TOKENS = 8192
SMALL_SHARE = 8
# Timed forwards per point, after one untimed (a CUDA graph's capture, a kernel's first launch).
REPEATS = 2


@dataclass(frozen=True)
class GroupTimes:
    """Seconds of one forward per group size at two token counts (tokens: the small and the large)."""

    tokens: tuple[int, int]
    seconds: dict[int, tuple[float, float]]  # group size -> (seconds at tokens[0], seconds at tokens[1])

    def seconds_at(self, size: int, tokens: int) -> float:
        """A forward's seconds on a group of `size` ranks at `tokens` tokens: the line through the two points, between
        them; the nearer point's outside."""
        (small, large), (at_small, at_large) = self.tokens, self.seconds[size]
        if tokens >= large:
            return at_large
        if tokens <= small:
            return at_small
        return at_small + (at_large - at_small) * (tokens - small) / (large - small)

    def describe(self) -> str:
        """One line for the log, e.g. "1 rank: 0.0120 s at 75 tokens, 0.0810 s at 600; 2 ranks: ..."."""
        small, large = self.tokens
        return "; ".join(f"{size} rank{'s' if size > 1 else ''}: {at_small:.4f} s at {small} tokens, {at_large:.4f} s "
                         f"at {large}" for size, (at_small, at_large) in self.seconds.items())


def measure_group_times(forward: Callable[[dict[str, torch.Tensor]], object],
                        request_of: Callable[[int], dict[str, torch.Tensor]], comm: Communicator, max_tokens: int,
                        calls: Callable[[int], int] = lambda size: 1) -> GroupTimes:
    """Time forward(request_of(tokens)) on this rank's group of every size of comm's elastic plan, at the two token
    counts; every rank of the world calls this together, after the ranks have met. calls(size): forwards a step runs
    one after another on a group of that size (a guided pipeline's two branches on a group too small for guidance
    parallelism, which runs them at once on a larger one)."""
    width = comm.plan.world_size  # token counts every group size splits evenly
    large = max(min(max_tokens, LARGEST_TOKENS) // width * width, width)
    small = max(large // SMALL_SHARE // width * width, width)
    sizes = comm.plan.group_sizes()
    seconds = torch.zeros(len(sizes), 2, dtype=torch.float64)
    for row, size in enumerate(sizes):
        with comm.bound_to(size):
            for column, tokens in enumerate((small, large)):
                inputs = request_of(tokens)
                forward(inputs)
                synchronize(comm)
                start = time.perf_counter()
                for _ in range(REPEATS):
                    forward(inputs)
                synchronize(comm)
                seconds[row, column] = (time.perf_counter() - start) / REPEATS * calls(size)
    agreed = comm.world_max(seconds.to(comm.device)).cpu()
    return GroupTimes((small, large), {size: (float(agreed[row, 0]), float(agreed[row, 1]))
                                       for row, size in enumerate(sizes)})


def synchronize(comm: Communicator) -> None:
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)
