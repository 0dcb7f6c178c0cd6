"""The parallel plan: how many ranks, how they split the model, and one rank's place in it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

CP_METHODS = ("allgather_kv", "ring", "ulysses")


@dataclass(frozen=True)
class ParallelPlan:
    """World = tensor-parallel size x context-parallel size.

    Ranks are laid out with tensor parallelism innermost: rank = cp_rank * tp_size + tp_rank, so
    the ranks that AllReduce every layer are neighbours (same NVLink island on bigger hosts).
    """

    tp_size: int = 1
    cp_size: int = 1
    cp_method: str = "allgather_kv"

    def __post_init__(self):
        if self.tp_size < 1 or self.cp_size < 1:
            raise ValueError(f"tp_size and cp_size must be >= 1, got {self.tp_size} and {self.cp_size}")
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"cp_method must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def cp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_group_ranks(self) -> list[list[int]]:
        """Every tensor-parallel group, as lists of global ranks."""
        return [[c * self.tp_size + t for t in range(self.tp_size)] for c in range(self.cp_size)]

    def cp_group_ranks(self) -> list[list[int]]:
        """Every context-parallel group, as lists of global ranks."""
        return [[c * self.tp_size + t for c in range(self.cp_size)] for t in range(self.tp_size)]

    def to_dict(self) -> dict:
        return {**asdict(self), "world_size": self.world_size}

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelPlan":
        plan = cls(tp_size=int(data["tp_size"]), cp_size=int(data["cp_size"]), cp_method=data["cp_method"])
        if "world_size" in data and int(data["world_size"]) != plan.world_size:
            raise ValueError(f"world_size {data['world_size']} is not tp_size x cp_size = {plan.world_size}")
        return plan

    def __str__(self) -> str:
        text = f"world {self.world_size} = tp {self.tp_size} x cp {self.cp_size}"
        return text + (f" ({self.cp_method})" if self.cp_size > 1 else "")
