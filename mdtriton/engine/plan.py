"""The parallel plan: how many ranks, how they split the model, and one rank's place in it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

CP_METHODS = ("allgather_kv", "ring", "ulysses", "ulysses_ring")


CFG_SIZES = (1, 2)


@dataclass(frozen=True)
class ParallelPlan:
    """World = classifier-free-guidance size x context-parallel size x tensor-parallel size.

    Ranks are laid out with tensor parallelism innermost and guidance outermost:
    rank = (cfg_rank * cp_size + cp_rank) * tp_size + tp_rank, so the ranks that AllReduce every layer are
    neighbours (same NVLink island on bigger hosts). With cfg_size 2 (pipelines only), each half of the ranks runs one
    branch of classifier-free guidance, the conditional (cfg rank 0) or the unconditional, and the halves exchange
    their outputs once per step.

    cp_method "ulysses_ring" (xDiT's USP) splits the context-parallel group into rings of Ulysses groups: ulysses_size
    neighbouring context-parallel ranks exchange heads by all-to-all, and the cp_size / ulysses_size groups pass
    key/value blocks around a ring. cp_rank = ring_rank * ulysses_size + ulysses_rank, so a Ulysses group is
    neighbours (one NVLink island). Every other method leaves ulysses_size 1.

    Worked layout, world 8 = tp 2 x cp 4 (ulysses_ring, ulysses_size 2): rank = cp_rank * 2 + tp_rank;
    tp groups [0 1] [2 3] [4 5] [6 7]; cp groups [0 2 4 6] [1 3 5 7]; Ulysses groups [0 2] [4 6] [1 3] [5 7];
    rings [0 4] [2 6] [1 5] [3 7].
    """

    tp_size: int = 1
    cp_size: int = 1
    cp_method: str = "allgather_kv"
    cfg_size: int = 1
    ulysses_size: int = 1
    elastic: bool = False  # each job runs on a group of the ranks (group_sizes; mdtriton.engine.elastic)

    def __post_init__(self):
        if self.tp_size < 1 or self.cp_size < 1:
            raise ValueError(f"tp_size and cp_size must be >= 1, got {self.tp_size} and {self.cp_size}")
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"cp_method must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}")
        if self.cfg_size not in CFG_SIZES:
            raise ValueError(f"cfg_size must be 1 or 2 (one rank group per guidance branch), got {self.cfg_size}")
        if self.cp_method == "ulysses_ring" and self.cp_size > 1 and not (
                1 < self.ulysses_size < self.cp_size and self.cp_size % self.ulysses_size == 0):
            raise ValueError(f"ulysses_ring needs a ulysses_size that divides cp_size {self.cp_size} and is neither 1 "
                             f"nor cp_size (a ring of at least 2 Ulysses groups), got {self.ulysses_size}; with "
                             "ulysses_size 1 or cp_size use cp_method ring or ulysses")
        if (self.cp_method != "ulysses_ring" or self.cp_size == 1) and self.ulysses_size != 1:
            raise ValueError(f"ulysses_size {self.ulysses_size} is for cp_method ulysses_ring, not {self.cp_method}")
        if self.elastic and self.tp_size > 1:
            raise ValueError("--elastic runs each job on a group of ranks that each hold the whole transformer; "
                             f"tensor parallelism (--tp {self.tp_size}) splits it across the ranks: build with --tp 1 "
                             "(context or guidance parallelism) or without --elastic")
        if self.elastic and (self.world_size < 2 or self.world_size & (self.world_size - 1)):
            raise ValueError(f"--elastic splits the world into groups of 1, 2, 4, ... ranks: it needs a world of 2, "
                             f"4, 8, ... ranks, not {self.world_size} ({self})")

    @property
    def ring_size(self) -> int:
        """Ranks of one ring of ulysses_ring (the ring of the ring method is the whole context-parallel group)."""
        return self.cp_size // self.ulysses_size

    @property
    def world_size(self) -> int:
        return self.cfg_size * self.cp_size * self.tp_size

    def check_heads(self, heads: int) -> None:
        """Raise ValueError, saying what to change, unless `heads` attention heads split evenly over the
        tensor-parallel ranks and, for ulysses, each tensor-parallel rank's heads over the context-parallel ranks."""
        if heads % self.tp_size:
            raise ValueError(f"num_attention_heads {heads} does not divide by tp_size {self.tp_size}; "
                             "choose a tp_size that divides the head count")
        local_heads = heads // self.tp_size
        if self.cp_size > 1 and self.cp_method == "ulysses" and local_heads % self.cp_size:
            raise ValueError(f"ulysses splits the {local_heads} heads of each tensor-parallel rank across cp_size "
                             f"{self.cp_size}, which does not divide them; use cp_method allgather_kv or ring, "
                             "ulysses_ring with a ulysses_size that divides them, or a cp_size that does")
        if self.cp_method == "ulysses_ring" and local_heads % self.ulysses_size:
            raise ValueError(f"ulysses_ring splits the {local_heads} heads of each tensor-parallel rank across "
                             f"ulysses_size {self.ulysses_size}, which does not divide them; choose a ulysses_size "
                             "that does")

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def cp_rank(self, rank: int) -> int:
        return rank // self.tp_size % self.cp_size

    def cfg_rank(self, rank: int) -> int:
        return rank // (self.tp_size * self.cp_size)

    def rank_of(self, cfg_rank: int, cp_rank: int, tp_rank: int) -> int:
        return (cfg_rank * self.cp_size + cp_rank) * self.tp_size + tp_rank

    def tp_group_ranks(self) -> list[list[int]]:
        """Every tensor-parallel group, as lists of global ranks (in rank order of their first rank)."""
        return [[self.rank_of(g, c, t) for t in range(self.tp_size)]
                for g in range(self.cfg_size) for c in range(self.cp_size)]

    def cp_group_ranks(self) -> list[list[int]]:
        """Every context-parallel group, as lists of global ranks (group g * tp_size + t holds tp rank t of guidance
        group g)."""
        return [[self.rank_of(g, c, t) for c in range(self.cp_size)]
                for g in range(self.cfg_size) for t in range(self.tp_size)]

    def ulysses_group_ranks(self) -> list[list[int]]:
        """ulysses_ring's Ulysses groups: ulysses_size context-parallel neighbours each, within every cp group."""
        return [ranks[start:start + self.ulysses_size] for ranks in self.cp_group_ranks()
                for start in range(0, self.cp_size, self.ulysses_size)]

    def ring_group_ranks(self) -> list[list[int]]:
        """ulysses_ring's rings: the ranks of one Ulysses place (ulysses rank) across the Ulysses groups of a cp
        group, in ring order."""
        return [ranks[place::self.ulysses_size] for ranks in self.cp_group_ranks() for place in range(self.ulysses_size)]

    def cfg_group_ranks(self) -> list[list[int]]:
        """Every guidance group: the ranks of one place in the cp x tp grid, one per branch."""
        return [[self.rank_of(g, c, t) for g in range(self.cfg_size)]
                for c in range(self.cp_size) for t in range(self.tp_size)]

    def group_sizes(self) -> list[int]:
        """The sizes of the groups an elastic plan runs jobs on, smallest first: 1, 2, 4, ... up to the world; a plan
        that does not regroup runs every job on the whole world."""
        if not self.elastic:
            return [self.world_size]
        return [1 << power for power in range(self.world_size.bit_length())]

    def group_partition(self, size: int) -> list[list[int]]:
        """The fixed groups of `size` ranks of an elastic plan: consecutive ranks, [0..size-1], [size..2 size-1], ...
        Groups of two sizes are nested or disjoint, so jobs on disjoint groups never share a rank."""
        return [list(range(start, start + size)) for start in range(0, self.world_size, size)]

    def group_plan(self, size: int) -> "ParallelPlan":
        """The plan a group of `size` ranks runs a job with: the same method at the group's degree. Guidance
        parallelism is kept while the group has room for both branches (it sends least: one exchange per step), and
        the context-parallel degree shrinks to the rest of the group: cfg 2 x ulysses 2 runs cfg 2 on a pair, and
        one rank runs alone. ulysses_ring keeps its Ulysses groups while the group holds a ring of two of them, and
        is plain ulysses below that."""
        if size == self.world_size:
            return self
        cfg = min(self.cfg_size, size)
        cp = size // cfg
        if self.cp_method == "ulysses_ring" and cp > self.ulysses_size:
            return ParallelPlan(cp_size=cp, cp_method="ulysses_ring", cfg_size=cfg, ulysses_size=self.ulysses_size)
        method = "ulysses" if self.cp_method == "ulysses_ring" else self.cp_method
        return ParallelPlan(cp_size=cp, cp_method=method, cfg_size=cfg)

    def to_dict(self) -> dict:
        data = {**asdict(self), "world_size": self.world_size}
        if not self.elastic:
            del data["elastic"]  # a plan that does not regroup is written as before the option existed
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelPlan":
        plan = cls(tp_size=int(data["tp_size"]), cp_size=int(data["cp_size"]), cp_method=data["cp_method"],
                   cfg_size=int(data.get("cfg_size", 1)), ulysses_size=int(data.get("ulysses_size", 1)),
                   elastic=bool(data.get("elastic", False)))
        if "world_size" in data and int(data["world_size"]) != plan.world_size:
            raise ValueError(f"world_size {data['world_size']} is not cfg_size x tp_size x cp_size = {plan.world_size}")
        return plan

    def __str__(self) -> str:
        guidance = f"cfg {self.cfg_size} x " if self.cfg_size > 1 else ""
        text = f"world {self.world_size} = {guidance}tp {self.tp_size} x cp {self.cp_size}"
        if self.cp_method == "ulysses_ring":
            text += f" (ulysses {self.ulysses_size} x ring {self.ring_size})"
        elif self.cp_size > 1:
            text += f" ({self.cp_method})"
        return text + (", elastic" if self.elastic else "")
