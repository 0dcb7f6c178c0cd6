"""The state of one rendezvous area (its `state.json`) as typed records, and how it is read and written.

backend/rendezvous.py changes it under the area's lock; JSON needs string keys, so ranks and epoch numbers
become strings only here, on the way to and from the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mdtriton.backend.private_directory import write_private_file

STATE_FILE = "state.json"  # in each area


@dataclass
class LoadFailure:
    """A rank of a load could not load its engine; the news stands while its process lives."""

    pid: int
    message: str


@dataclass
class EpochRecord:
    """One epoch: the ranks that meet in it, as they enter, load and form their group."""

    token: str  # the job hub's authentication key
    members: dict[int, int] = field(default_factory=dict)  # rank -> pid holding its slot
    entered: set[int] = field(default_factory=set)  # every rank that ever took a slot (a failed rank waits for all)
    loaded: dict[int, int] = field(default_factory=dict)  # rank -> pid of the members that have loaded
    closed: bool = False  # every rank has its slot: no other process may enter
    failed: LoadFailure | None = None

    def all_loaded(self) -> bool:
        return self.closed and self.loaded == self.members

    def to_json(self) -> dict:
        return {"token": self.token, "closed": self.closed,
                "members": {str(rank): pid for rank, pid in self.members.items()},
                "entered": sorted(self.entered),
                "loaded": {str(rank): pid for rank, pid in self.loaded.items()},
                "failed": None if self.failed is None else {"pid": self.failed.pid, "message": self.failed.message}}

    @classmethod
    def from_json(cls, record: dict) -> "EpochRecord":
        failed = record["failed"]
        return cls(token=record["token"], closed=record["closed"],
                   members={int(rank): pid for rank, pid in record["members"].items()},
                   entered=set(record["entered"]),
                   loaded={int(rank): pid for rank, pid in record["loaded"].items()},
                   failed=None if failed is None else LoadFailure(failed["pid"], failed["message"]))


@dataclass
class AreaState:
    """Every epoch of the area that still has members, and which one a starting rank enters."""

    current: int = 0  # the epoch a rank that starts loading enters, while it is open
    last: int = 0  # the highest epoch number given so far (numbers are never reused)
    epochs: dict[int, EpochRecord] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> "AreaState":
        """The state in `path`; an empty one if there is no such file (the area is new, or was removed)."""
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        return cls(current=state["current"], last=state["last"],
                   epochs={int(number): EpochRecord.from_json(record)
                           for number, record in state["epochs"].items()})

    def write(self, path: Path) -> None:
        """Replace `path` atomically with this state, readable by this user only (it holds the hubs' keys)."""
        write_private_file(path, json.dumps({
            "current": self.current, "last": self.last,
            "epochs": {str(number): record.to_json() for number, record in self.epochs.items()}}))
