"""The one place that owns process groups; model code calls the named collectives below.

A Communicator knows this rank's place in the plan from the start (so a model can be built and its
weights loaded before the ranks meet); `join_groups()` creates the process groups once
torch.distributed is initialised. Every collective is a no-op when its group has one rank, so the
same model code runs on 1..N ranks.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from mdtriton.engine.plan import ParallelPlan


class Communicator:
    """This rank's tensor-parallel and context-parallel groups, and the collectives over them."""

    def __init__(self, plan: ParallelPlan, rank: int, device: torch.device):
        self.plan = plan
        self.rank = rank
        self.device = torch.device(device)
        self.tp_rank = plan.tp_rank(rank)
        self.cp_rank = plan.cp_rank(rank)
        self._tp_group = None
        self._cp_group = None
        self._cp_ranks = plan.cp_group_ranks()[self.tp_rank] if plan.cp_size > 1 else [rank]
        # Optional hook: a callable returning a context manager wrapped around every collective (the
        # backend's metrics time them with it).
        self.collective_timer = None

    def _timed(self):
        return self.collective_timer() if self.collective_timer is not None else nullcontext()

    def join_groups(self) -> None:
        """Create the tensor- and context-parallel groups; every rank calls this together."""
        plan, rank = self.plan, self.rank
        if plan.world_size == 1:
            return
        if not dist.is_initialized() or dist.get_world_size() != plan.world_size:
            raise RuntimeError(
                f"the plan needs {plan.world_size} ranks in an initialised torch.distributed world "
                f"(found {dist.get_world_size() if dist.is_initialized() else 'none'})"
            )
        # new_group is collective over the whole world: every rank creates every group, in order.
        for ranks in plan.tp_group_ranks():
            group = dist.new_group(ranks)
            if rank in ranks:
                self._tp_group = group
        for ranks in plan.cp_group_ranks():
            group = dist.new_group(ranks)
            if rank in ranks:
                self._cp_group = group

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "Communicator":
        """A communicator for one rank: every collective returns its input."""
        return cls(ParallelPlan(), 0, torch.device(device))

    @property
    def tp_size(self) -> int:
        return self.plan.tp_size

    @property
    def cp_size(self) -> int:
        return self.plan.cp_size

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel layer across the tensor-parallel group, in place."""
        if self.tp_size > 1:
            with self._timed():
                dist.all_reduce(x, group=self._tp_group)
        return x

    def cp_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every context-parallel rank's slice of x along dim, in rank order."""
        if self.cp_size == 1:
            return x
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((self.cp_size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        with self._timed():
            dist.all_gather_into_tensor(out, moved, group=self._cp_group)
        return out.movedim(0, dim)

    def cp_all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Split x into cp_size chunks along scatter_dim, send chunk i to rank i, concatenate along gather_dim."""
        if self.cp_size == 1:
            return x
        chunks = [c.contiguous() for c in x.chunk(self.cp_size, dim=scatter_dim)]
        received = [torch.empty_like(c) for c in chunks]
        with self._timed():
            dist.all_to_all(received, chunks, group=self._cp_group)
        return torch.cat(received, dim=gather_dim)

    def cp_ring_shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Start sending tensors to the next context-parallel rank and receiving the previous rank's.

        Returns the receive buffers and the pending works; wait on the works before reading them.
        """
        position = self._cp_ranks.index(self.rank)
        send_to = self._cp_ranks[(position + 1) % self.cp_size]
        recv_from = self._cp_ranks[(position - 1) % self.cp_size]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, send_to, group=self._cp_group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, recv_from, group=self._cp_group) for r in received]
        with self._timed():
            works = dist.batch_isend_irecv(ops)
        return received, works

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Copy x from global rank src to every rank of the world, in place."""
        if self.plan.world_size > 1:
            with self._timed():
                dist.broadcast(x, src=src)
        return x
