"""The one place that owns process groups; model code calls the named collectives below.

A Communicator knows this rank's place in the plan from the start (so a model can be built and its
weights loaded before the ranks meet); `connect()` forms the process groups of one epoch of the
ranks and `disconnect()` ends them, so the same processes can form a new epoch after a failure
(`join_groups()` alone creates the groups when torch.distributed was initialised elsewhere). Every
collective is a no-op when its group has one rank, so the same model code runs on 1..N ranks.

A collective that fails in the backend (a peer exited, stopped past the timeout, or left; the groups were aborted)
raises CommunicationError: the groups cannot be used again, and the caller must disconnect and form a new
epoch. Any other error is the caller's (a programming error) and keeps its own type.

The device contract: every tensor handed to a collective lives on this rank's device (`Communicator.device`), the
only memory NCCL can send; gloo would take host memory too, so CPU ranks would hide a host tensor that GPU ranks
refuse. Each collective checks it before this rank enters it, and that chunks it sends are equal (the peers would
wait for other sizes): CollectiveInputError, a programming error, raised before this rank enters the collective
(torch's own checks of a collective's arguments also fail before it, and keep their type). Engines keep to the
contract by answering on their device (mdtriton.engine.engine).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mdtriton.engine.plan import ParallelPlan


class CommunicationError(RuntimeError):
    """A collective failed: a peer rank exited, stopped or left, or the collective timed out."""


class CollectiveInputError(TypeError):
    """A programming error: a collective was handed a tensor that is not on this rank's device, or not laid out as the
    collective needs. Raised before this rank enters the collective."""


def is_backend_failure(error: Exception) -> bool:
    """Whether a collective's error comes from the backend: torch.distributed's own errors (NCCL's DistBackendError, the
    store's, the network's), gloo's transport (a lost peer, a timeout: plain RuntimeErrors naming gloo's source), or the
    groups ended under the collective (aborted when a peer exited). Not a tensor the backend refused."""
    return isinstance(error, dist.DistError) or "/gloo/transport/" in str(error) or not dist.is_initialized()


def group_with(rank: int, partition: list[list[int]]) -> list[int]:
    """The group of a partition of the world's ranks that holds rank."""
    return next(ranks for ranks in partition if rank in ranks)


def first_sentence(error: Exception) -> str:
    """The gist of a backend error: its first sentence, without gloo's "[source.cc:123] " prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    return text.splitlines()[0].split(". ")[0] if text else type(error).__name__


# What a Communicator holds of the group of ranks it spans: what bound_to swaps for one job (an elastic plan).
GROUP_STATE = ("plan", "rank", "members", "partition", "tp_rank", "cp_rank", "cfg_rank", "_world_group", "_tp_group",
               "_cp_group", "_cfg_group", "_ulysses_group", "_ring_group", "_ulysses_ranks", "_ring_ranks")


class Communicator:
    """This rank's tensor-parallel, context-parallel and guidance groups, and the collectives over them.

    It spans the whole world, or, for an elastic plan's job, one group of the ranks: `members` (global ranks, in the
    order of the group's plan) of a partition of the world (`partition`, every group of that size, which every rank
    forms together). `rank` and every rank a collective names are places in `members`."""

    def __init__(self, plan: ParallelPlan, rank: int, device: torch.device, members: list[int] | None = None,
                 partition: list[list[int]] | None = None):
        """members, partition: for a group's communicator, the group (global ranks; this rank at place `rank`) and
        every group of the world of its size, members among them; None: the whole world (rank: the global rank)."""
        self.plan = plan
        self.members = members if members is not None else list(range(plan.world_size))
        self.partition = partition if partition is not None else [self.members]
        self.rank = rank
        self.device = torch.device(device)
        self.tp_rank = plan.tp_rank(rank)
        self.cp_rank = plan.cp_rank(rank)
        self.cfg_rank = plan.cfg_rank(rank)
        self._world_group = None  # None: torch's default group, the whole world
        self._tp_group = None
        self._cp_group = None
        self._cfg_group = None
        self._ulysses_group = None
        self._ring_group = None
        # The global ranks of this rank's Ulysses group and ring, in order: ulysses_ring's subgroups of the
        # context-parallel group; for ulysses and ring, the context-parallel group is the one that exchanges heads
        # or passes blocks.
        cp_ranks = self._global(group_with(rank, plan.cp_group_ranks()))
        match plan.cp_method:
            case "ulysses_ring":
                self._ulysses_ranks = self._global(group_with(rank, plan.ulysses_group_ranks()))
                self._ring_ranks = self._global(group_with(rank, plan.ring_group_ranks()))
            case "ulysses":
                self._ulysses_ranks, self._ring_ranks = cp_ranks, [self.members[rank]]
            case "ring":
                self._ulysses_ranks, self._ring_ranks = [self.members[rank]], cp_ranks
            case _:
                self._ulysses_ranks = self._ring_ranks = [self.members[rank]]
        # Optional hook: a callable returning a context manager wrapped around every collective (the
        # backend's metrics time them with it).
        self.collective_timer = None
        self._rehearsing = False
        # An elastic plan's communicators of this rank's smaller groups, by size (formed with the world's).
        self.groups: dict[int, Communicator] = {}
        if plan.elastic:
            for size in plan.group_sizes()[:-1]:
                groups = plan.group_partition(size)
                members = group_with(rank, groups)
                self.groups[size] = Communicator(plan.group_plan(size), members.index(rank), device, members, groups)

    def _global(self, places: list[int]) -> list[int]:
        return [self.members[place] for place in places]

    @contextmanager
    def bound_to(self, size: int):
        """Within it, this communicator is that of this rank's group of `size` ranks (an elastic plan's job there).

        The engine's modules keep the communicator they were loaded with: binding it to a group for a job (this
        rank's state of the group swapped in, and back after) is how one loaded engine runs on any group. The whole
        world's size binds nothing."""
        if size == self.plan.world_size:
            yield self
            return
        group = self.groups[size]
        saved = {name: getattr(self, name) for name in GROUP_STATE}
        for name in GROUP_STATE:
            setattr(self, name, getattr(group, name))
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    @contextmanager
    def rehearsal(self):
        """Within it, collectives communicate nothing and return tensors of the shapes they would return.

        For running a rank's model alone before the ranks meet (compiling it at load), never for answers.
        """
        self._rehearsing = True
        try:
            yield
        finally:
            self._rehearsing = False

    def check_device(self, what: str, *tensors: torch.Tensor) -> None:
        """The device contract (module docstring): refuse, before the collective, a tensor on another device."""
        for tensor in tensors:
            if tensor.device.type != self.device.type or (self.device.index is not None
                                                          and tensor.device.index != self.device.index):
                raise CollectiveInputError(
                    f"{what} on rank {self.rank} was handed a tensor on {tensor.device}; this rank's collectives take "
                    f"tensors on {self.device} only (NCCL cannot send host memory): move it there first")

    def check_splits(self, what: str, tensor: torch.Tensor, parts: int, dim: int) -> None:
        """A collective that sends a tensor's chunks needs `parts` equal chunks along dim: refuse another before it."""
        if tensor.shape[dim] % parts:
            raise CollectiveInputError(f"{what} on rank {self.rank} was handed a tensor of {tensor.shape[dim]} along "
                                       f"dimension {dim}, not a multiple of the {parts} ranks it is split over")

    def _timed(self):
        return self.collective_timer() if self.collective_timer is not None else nullcontext()

    def connect(self, store_path: Path, timeout: float) -> None:
        """Form the world of this epoch (every rank calls this together) and its tp/cp groups.

        `timeout` bounds every collective. On gloo a peer that stops answering makes it raise CommunicationError
        after that long. NCCL's collectives are queued on the GPU with no wait on the CPU (the wait at each that
        TORCH_NCCL_BLOCKING_WAIT makes cannot be captured in a CUDA graph, which a served forward of several ranks
        replays), so the caller bounds the wait for a job's work itself (mdtriton.backend.job_runner
        .wait_for_device); TORCH_NCCL_ASYNC_ERROR_HANDLING=0 keeps torch's watchdog from ending the whole process
        at the timeout, as it does by default, so the ranks can abort this group and form a new one.
        """
        if self.plan.world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        with self._collective("forming the process group"):
            dist.init_process_group(backend, store=dist.FileStore(str(store_path), self.plan.world_size),
                                    rank=self.rank, world_size=self.plan.world_size,
                                    timeout=timedelta(seconds=timeout),
                                    device_id=self.device if backend == "nccl" else None)
            self.join_groups(timedelta(seconds=timeout))

    def disconnect(self) -> None:
        """End this epoch's groups; a peer blocked in a collective with this rank then fails at once.

        NCCL groups are aborted, not destroyed: destroying waits for the peers, which may be gone.
        """
        if self.plan.world_size == 1 or not dist.is_initialized():
            return
        if self.device.type == "cuda":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
        for communicator in (self, *self.groups.values()):
            communicator._world_group = None
            communicator._tp_group = communicator._cp_group = communicator._cfg_group = None
            communicator._ulysses_group = communicator._ring_group = None

    @contextmanager
    def _collective(self, what: str, timed: bool = True):
        """Time a collective (the collective_timer hook) and report a failure of the backend as CommunicationError,
        naming this rank and the operation; any other error passes as it is (a programming error)."""
        try:
            with self._timed() if timed else nullcontext():
                yield
        except RuntimeError as error:  # gloo and NCCL (DistBackendError) report lost peers and timeouts as this
            if not is_backend_failure(error):
                raise
            raise CommunicationError(f"{what} failed on rank {self.rank}: {first_sentence(error)}") from error

    def join_groups(self, timeout: timedelta | None = None) -> None:
        """Create the tensor-parallel, context-parallel and guidance groups (an elastic plan's: those of every group
        of ranks too); every rank calls this together.

        timeout bounds their collectives (a group does not inherit the world's timeout; None: torch's default).
        """
        plan = self.plan
        if plan.world_size == 1:
            return
        world_size = sum(map(len, self.partition))
        if not dist.is_initialized() or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"the plan needs {world_size} ranks in an initialised torch.distributed world "
                f"(found {dist.get_world_size() if dist.is_initialized() else 'none'})"
            )
        # new_group is collective over the whole world: every rank creates every group, in order (for a group's
        # communicator: those of every group of its partition, one after another).
        for members in self.partition:
            mine = members is self.members
            if self.partition[1:]:
                world_group = dist.new_group(members, timeout=timeout)
                if mine:
                    self._world_group = world_group
            tp = self._group_of(members, plan.tp_group_ranks(), timeout)
            cp = self._group_of(members, plan.cp_group_ranks(), timeout)
            cfg = self._group_of(members, plan.cfg_group_ranks(), timeout)
            if plan.cp_method == "ulysses_ring":
                ulysses = self._group_of(members, plan.ulysses_group_ranks(), timeout)
                ring = self._group_of(members, plan.ring_group_ranks(), timeout)
            else:
                ulysses = ring = cp
            if mine:
                self._tp_group, self._cp_group, self._cfg_group = tp, cp, cfg
                self._ulysses_group, self._ring_group = ulysses, ring
        for group in self.groups.values():  # an elastic plan's smaller groups, smallest first (every rank alike)
            group.join_groups(timeout)

    def _group_of(self, members: list[int], partition: list[list[int]], timeout: timedelta | None):
        """Create every group of a partition of the ranks `members` (places in it; all ranks of the world together);
        return this rank's (None if this rank is not among members)."""
        mine = None
        for places in partition:
            ranks = [members[place] for place in places]
            group = dist.new_group(ranks, timeout=timeout)
            if members is self.members and self.members[self.rank] in ranks:
                mine = group
        return mine

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

    @property
    def cfg_size(self) -> int:
        return self.plan.cfg_size

    @property
    def ulysses_size(self) -> int:
        """Ranks that exchange heads by all-to-all (attention.ulysses); 1 for the methods that do not."""
        return len(self._ulysses_ranks)

    @property
    def ring_size(self) -> int:
        """Ranks that pass key/value blocks around a ring (attention.ring); 1 for the methods that do not."""
        return len(self._ring_ranks)

    @property
    def ring_rank(self) -> int:
        """This rank's place in its ring: the block of the sequence it holds once its Ulysses group has exchanged."""
        return self._ring_ranks.index(self.members[self.rank])

    def cfg_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[cfg_size, *x.shape]: x of every guidance group's rank at this rank's place, in guidance-rank order."""
        if self.cfg_size == 1:
            return x.unsqueeze(0)
        if self._rehearsing:
            return torch.stack([x] * self.cfg_size)
        self.check_device("guidance all-gather", x)
        out = torch.empty((self.cfg_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        with self._collective("guidance all-gather"):
            dist.all_gather_into_tensor(out, x.contiguous(), group=self._cfg_group)
        return out.unflatten(0, (self.cfg_size, x.shape[0]))

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel layer across the tensor-parallel group, in place."""
        if self.tp_size > 1:
            self._tp_all_reduce(x)
        return x

    # Eager inside compiled regions (a graph break): the regions between collectives are what compiles. (The attention
    # package's docstring says why torch._disable_dynamo.)
    @torch._disable_dynamo
    def _tp_all_reduce(self, x: torch.Tensor) -> None:
        if self._rehearsing:
            return
        self.check_device("tensor-parallel all-reduce", x)
        with self._collective("tensor-parallel all-reduce"):
            dist.all_reduce(x, group=self._tp_group)

    def cp_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every context-parallel rank's slice of x along dim, in rank order."""
        if self.cp_size == 1:
            return x
        if self._rehearsing:
            return torch.cat([x] * self.cp_size, dim=dim)
        self.check_device("context-parallel all-gather", x)
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((self.cp_size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        with self._collective("context-parallel all-gather"):
            dist.all_gather_into_tensor(out, moved, group=self._cp_group)
        return out.movedim(0, dim)

    def cp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the context-parallel group (a new tensor; x as it is with one context-parallel rank)."""
        if self.cp_size == 1 or self._rehearsing:
            return x
        self.check_device("context-parallel all-reduce", x)
        total = x.clone()
        with self._collective("context-parallel all-reduce"):
            dist.all_reduce(total, group=self._cp_group)
        return total

    def cp_all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> "Pending":
        """Start gathering every context-parallel rank's x into out ([cp_size, *x.shape], in rank order): x and out
        contiguous. Read out only after the returned Pending's wait()."""
        if self.cp_size == 1:
            out[0].copy_(x)
            return Pending(self, "context-parallel all-gather", [])
        if self._rehearsing:
            return Pending(self, "context-parallel all-gather", [])
        self.check_device("context-parallel all-gather", x, out)
        with self._collective("context-parallel all-gather"):
            work = dist.all_gather_into_tensor(out.view(-1, *x.shape[1:]), x, group=self._cp_group, async_op=True)
        return Pending(self, "context-parallel all-gather", [work])

    def ulysses_all_to_all(self, out: torch.Tensor, x: torch.Tensor) -> "Pending":
        """Start sending x[i] to rank i of the Ulysses group and receiving its x[this rank] into out[i] (x and out:
        [ulysses_size, ...], contiguous). Read out only after the returned Pending's wait()."""
        if self.ulysses_size == 1:
            out.copy_(x)
            return Pending(self, "Ulysses all-to-all", [])
        if self._rehearsing:
            return Pending(self, "Ulysses all-to-all", [])
        self.check_device("Ulysses all-to-all", x, out)
        self.check_splits("Ulysses all-to-all", x, self.ulysses_size, 0)
        with self._collective("Ulysses all-to-all"):
            work = dist.all_to_all_single(out, x, group=self._ulysses_group, async_op=True)
        return Pending(self, "Ulysses all-to-all", [work])

    def ring_shift(self, sends: Sequence[torch.Tensor], receives: Sequence[torch.Tensor],
                   sends_back: Sequence[torch.Tensor] = (), receives_back: Sequence[torch.Tensor] = ()) -> "Pending":
        """Start sending each of `sends` to the next rank of this rank's ring and receiving the previous rank's into
        the receive at its place, and each of `sends_back` to the previous rank, receiving the next rank's into
        `receives_back` (one batched send/receive; each tensor contiguous). Read the receives, or write the sends,
        only after the returned Pending's wait()."""
        if self._rehearsing:
            return Pending(self, "ring shift", [])
        self.check_device("ring shift", *sends, *receives, *sends_back, *receives_back)
        position = self.ring_rank
        following = self._ring_ranks[(position + 1) % self.ring_size]
        preceding = self._ring_ranks[(position - 1) % self.ring_size]
        ops = [dist.P2POp(dist.isend, send, following, group=self._ring_group) for send in sends]
        ops += [dist.P2POp(dist.irecv, receive, preceding, group=self._ring_group) for receive in receives]
        ops += [dist.P2POp(dist.isend, send, preceding, group=self._ring_group) for send in sends_back]
        ops += [dist.P2POp(dist.irecv, receive, following, group=self._ring_group) for receive in receives_back]
        with self._collective("ring shift"):
            works = dist.batch_isend_irecv(ops)
        return Pending(self, "ring shift", works)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over every rank of the world (a new tensor; x as it is with one rank)."""
        if self.plan.world_size == 1 or self._rehearsing:
            return x
        self.check_device("all-reduce", x)
        total = x.clone()
        with self._collective("all-reduce"):
            dist.all_reduce(total, group=self._world_group)
        return total

    def all_gather(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """Every rank's x, concatenated along dim in rank order, where rank r's x has sizes[r] there (the sizes may
        differ: each is sent padded to the largest)."""
        world_size = self.plan.world_size
        if world_size == 1:
            return x
        widest = max(sizes)
        moved = x.movedim(dim, 0)
        padded = torch.zeros((widest, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        padded[: moved.shape[0]] = moved
        if self._rehearsing:
            out = padded.repeat(world_size, *[1] * (padded.ndim - 1))
        else:
            self.check_device("all-gather", x)
            out = torch.empty((world_size * widest, *moved.shape[1:]), dtype=x.dtype, device=x.device)
            with self._collective("all-gather"):
                dist.all_gather_into_tensor(out, padded, group=self._world_group)
        return torch.cat([out[r * widest: r * widest + size].movedim(0, dim) for r, size in enumerate(sizes)], dim)

    def halo_exchange(self, x: torch.Tensor, dim: int, width: int) -> torch.Tensor:
        """x with `width` slices along dim before it from the previous rank of the world (its last ones) and after it
        from the next rank (its first ones); zeros before rank 0 and after the last rank, as a convolution's zero
        padding. For work split into bands of rows in rank order: each rank's x must have at least width slices."""
        if width == 0:
            return x
        world_size, rank = self.plan.world_size, self.rank
        shape = list(x.shape)
        shape[dim] = width
        before = torch.zeros(shape, dtype=x.dtype, device=x.device)
        after = torch.zeros_like(before)
        if world_size > 1 and not self._rehearsing:
            self.check_device("halo exchange", x)
            ops = []
            previous, following = self.members[rank - 1], self.members[(rank + 1) % world_size]
            group = self._world_group
            if rank > 0:
                ops += [dist.P2POp(dist.isend, x.narrow(dim, 0, width).contiguous(), previous, group=group),
                        dist.P2POp(dist.irecv, before, previous, group=group)]
            if rank < world_size - 1:
                ops += [dist.P2POp(dist.isend, x.narrow(dim, x.shape[dim] - width, width).contiguous(), following,
                                   group=group),
                        dist.P2POp(dist.irecv, after, following, group=group)]
            with self._collective("halo exchange"):
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        return torch.cat((before, x, after), dim)

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Copy x from rank src to every rank of the world (of the group, bound to one), in place."""
        if self.plan.world_size > 1 and not self._rehearsing:
            if not 0 <= src < len(self.members):
                raise CollectiveInputError(f"broadcast from rank {src}: no such rank among the {len(self.members)} "
                                           "taking part")
            self.check_device(f"broadcast from rank {src}", x)
            with self._collective(f"broadcast from rank {src}"):
                dist.broadcast(x, src=self.members[src], group=self._world_group)
        return x

    def world_max(self, x: torch.Tensor) -> torch.Tensor:
        """x's elementwise maximum over every rank of the world, in place: how the ranks agree on a job's fate
        (mdtriton.engine.job_control)."""
        if self.plan.world_size > 1 and not self._rehearsing:
            self.check_device("world maximum", x)
            with self._collective("world maximum"):
                dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self._world_group)
        return x


class Pending:
    """Collectives started without waiting (async on NCCL's own stream, so compute can run meanwhile).

    wait() makes the current stream wait for them on a GPU (no host sync), or waits for them on the CPU (gloo). The
    wait is what the collective_timer hook times: the communication that compute did not hide."""

    def __init__(self, comm: Communicator, what: str, works: list):
        self._comm = comm
        self._what = what
        self._works = works

    def wait(self) -> None:
        with self._comm._collective(f"waiting for a {self._what}"):
            for work in self._works:
                work.wait()
