"""How the ranks of one loaded model version find each other, without ever meeting another load's ranks.

The rendezvous area is a directory per (Triton server process, model, version) holding `state.json`,
guarded by a file lock. The ranks meet in numbered *epochs*: a rank enters the open epoch as
it starts loading, and once all world_size ranks have entered, it is closed for good; its members form
their group once every one of them has loaded (or give up at once when one reports that it cannot load).
The ranks are the worker processes of the model's instances (backend/rank_worker.py). A rank opens a new
epoch when the current one is closed or already has a member of its rank, so:
- ranks initialised in parallel or one after another meet in the same open epoch (a slot
  held by a process that died before the epoch closed is given to the next comer);
- a reload (new instances while the old ones still serve) finds the old epoch closed and opens
  a new one, which the old load's ranks never read again;
- an epoch serves until anything goes wrong in it; then every rank's worker exits and its stub starts a
  new one (backend/worker_keeper.py): the new workers enter and meet in a fresh epoch, like a load's
  first ones. (Old workers healing at the very moment a reload's first workers enter could meet them; the
  areas do not tell loads apart.)
Joining never blocks Triton: callers wait for the epoch to close in a thread. The areas' root is private
to the server's user, and so are the files in it (backend/private_directory.py): state.json holds the job hub's
authentication key.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mdtriton.backend.private_directory import PRIVATE_DIRECTORY_MODE, make_private_directory, open_private_file
from mdtriton.backend.process_state import ProcessState, process_state
from mdtriton.backend.rendezvous_state import STATE_FILE, AreaState, EpochRecord, LoadFailure

ROOT_ENV = "MDTRITON_RENDEZVOUS_DIR"
MAX_UNIX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
# The longest a rank that could not load waits for the other ranks of its load to come and see it. Triton
# 2.51 starts a model's instances in parallel, so they come within seconds (later on a loaded machine); a
# rank that missed the news would load, carry on alone, and leave Triton with one instance loaded and one
# failed. Only a server that starts instances one after another waits this long to report the failure.
FAILURE_NOTICE_S = 20.0
# The name of an area (see rendezvous_dir): server pid, model name, its digest, version.
AREA_NAME = re.compile(r"(\d+)-.*-[0-9a-f]{8}-v\d+")
# The file in an epoch's directory through which its ranks form their process group (torch's FileStore).
STORE_FILE = "store"


class RendezvousTimeout(Exception):
    """Not every rank joined in time (or this rank was asked to stop while waiting)."""


class RankFailedToLoad(Exception):
    """A rank of this load could not load its engine (or was given up), so this epoch will never form."""


@dataclass(frozen=True)
class Epoch:
    number: int
    directory: Path
    token: str
    members: dict[int, int] = field(default_factory=dict)  # rank -> pid

    @property
    def store_path(self) -> Path:
        return self.directory / STORE_FILE

    @property
    def hub_address(self) -> str:
        return str(self.directory / "hub")


def rendezvous_root() -> Path:
    """The directory holding every rendezvous area of this host's servers (private to their user: see _lock)."""
    return Path(os.environ.get(ROOT_ENV) or Path(tempfile.gettempdir()) / "mdtriton-rendezvous")


def rendezvous_dir(model_name: str, model_version: str) -> Path:
    """The area shared by the ranks of this model version in this server (the stubs' parent process)."""
    root = rendezvous_root()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model_name)[:40]
    digest = hashlib.sha1(model_name.encode()).hexdigest()[:8]
    # Unix socket paths are limited to ~107 bytes, so keep this short.
    return root / f"{os.getppid()}-{safe}-{digest}-v{model_version}"


def _alive(pid: int) -> bool:
    return process_state(pid) is not ProcessState.EXITED


def remove_areas_of_dead_servers(root: Path) -> None:
    """Remove the rendezvous areas of servers that have exited (a killed server's stubs never clean up)."""
    if not root.is_dir():
        return
    for area in root.iterdir():
        match = AREA_NAME.fullmatch(area.name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(area, ignore_errors=True)


class Rendezvous:
    """This rank's handle on the rendezvous area."""

    def __init__(self, directory: Path, rank: int, world_size: int):
        self.directory = Path(directory)
        longest_socket = self.directory / "epoch1234567" / "hub"
        if len(str(longest_socket).encode()) > MAX_UNIX_SOCKET_PATH:
            raise ValueError(f"the rendezvous area {self.directory} is too deep for the Unix sockets it holds "
                             f"(at most {MAX_UNIX_SOCKET_PATH} bytes); set {ROOT_ENV} to a shorter directory")
        self.rank = rank
        self.world_size = world_size
        self.pid = os.getpid()

    @property
    def _state_path(self) -> Path:
        return self.directory / STATE_FILE

    @contextmanager
    def _locked_state(self):
        """The area's state, under its lock, written back when the block ends."""
        with self._lock():
            state = AreaState.read(self._state_path)
            yield state
            state.write(self._state_path)

    @contextmanager
    def _lock(self):
        """An exclusive lock on the area; retried if the last member removed the area meanwhile.

        The area's parent, the rendezvous root, must be private to this user (backend/private_directory.py)."""
        while True:
            make_private_directory(self.directory.parent, ROOT_ENV)
            self.directory.mkdir(mode=PRIVATE_DIRECTORY_MODE, exist_ok=True)
            with os.fdopen(open_private_file(self.directory / "lock", os.O_RDWR | os.O_APPEND), "a+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    same_file = os.stat(self.directory / "lock").st_ino == os.fstat(lock.fileno()).st_ino
                except FileNotFoundError:
                    same_file = False
                if same_file:
                    yield
                    return

    def _forget(self, state: AreaState, number: int) -> None:
        del state.epochs[number]
        shutil.rmtree(self.directory / f"epoch{number}", ignore_errors=True)

    def _remove_dead_epochs(self, state: AreaState) -> None:
        """Forget epochs whose members have all exited (killed ranks never leave by themselves).

        The open fresh epoch stays: the next comer takes over the slots of its dead members.
        """
        for number, epoch in list(state.epochs.items()):
            open_fresh = number == state.current and not epoch.closed
            if not open_fresh and not any(_alive(pid) for pid in epoch.members.values()):
                self._forget(state, number)

    def enter(self) -> int:
        """Take this rank's slot in the open fresh epoch (opening one if needed); return its number.

        Called as a rank starts loading, so a rank that fails to load finds the others already there.
        """
        with self._locked_state() as state:
            self._remove_dead_epochs(state)
            current = state.epochs.get(state.current)
            if current is not None and current.failed is not None and not _alive(current.failed.pid):
                current = None  # the failure of a load that is over
            if current is not None and not current.closed:
                # No group has formed in an open epoch yet, so a slot held by a dead process is free.
                current.members = {rank: pid for rank, pid in current.members.items() if _alive(pid)}
            if current is None or current.closed or self.rank in current.members:
                state.current = self._open(state)
                current = state.epochs[state.current]
            current.members[self.rank] = self.pid
            current.entered.add(self.rank)
            current.closed = len(current.members) == self.world_size
            return state.current

    def _open(self, state: AreaState) -> int:
        """Add a new, empty epoch and return its number."""
        state.last += 1
        state.epochs[state.last] = EpochRecord(token=secrets.token_hex(16))
        directory = self.directory / f"epoch{state.last}"
        directory.mkdir(mode=PRIVATE_DIRECTORY_MODE, exist_ok=True)
        # Created here, 0600, so that torch's FileStore (which would create it with the default mode) opens it as is.
        os.close(open_private_file(directory / STORE_FILE, os.O_WRONLY))
        return state.last

    def _epoch(self, number: int, epoch: EpochRecord) -> Epoch:
        return Epoch(number, self.directory / f"epoch{number}", epoch.token, dict(epoch.members))

    def join(self, timeout: float, stop: threading.Event, number: int | None = None) -> Epoch:
        """Say this rank has loaded, and wait until every rank of epoch `number` (entered before; None:
        enter now) has entered it and loaded.

        Raises RankFailedToLoad as soon as a rank of this load reports that it could not load.
        """
        remove_areas_of_dead_servers(self.directory.parent)
        deadline = time.monotonic() + timeout
        number = self.enter() if number is None else number
        while True:
            failure = None
            with self._locked_state() as state:
                epoch = state.epochs.get(number)
                if epoch is not None and epoch.failed is not None:
                    failure = epoch.failed.message
                elif epoch is not None and (epoch.closed or state.current == number):
                    epoch.loaded[self.rank] = self.pid
                    if epoch.all_loaded():
                        return self._epoch(number, epoch)
                else:
                    # Superseded before it closed (a member died and was restarted): join the newer one.
                    self._leave_locked(state, number)
                    number = None
            if failure is not None:
                self.leave(number)
                raise RankFailedToLoad(failure)
            if number is None:
                number = self.enter()
                continue
            if stop.is_set():
                self.leave(number)
                raise RendezvousTimeout("stopped while waiting for the other ranks")
            if time.monotonic() > deadline:
                epoch = self._peek_state().epochs[number]
                absent = sorted(set(range(self.world_size)) - set(epoch.members))
                loading = sorted(rank for rank, pid in epoch.members.items() if epoch.loaded.get(rank) != pid)
                self.leave(number)
                late = [f"ranks {absent} did not join"] if absent else []
                late += [f"ranks {loading} did not finish loading"] if loading else []
                raise RendezvousTimeout(f"{' and '.join(late)} within {timeout:.0f} s")
            time.sleep(0.05)

    def fail(self, number: int, message: str) -> None:
        """Tell the ranks of epoch `number` that this rank cannot take part (message, which names the rank, says
        why: it could not load, or it was given up after crashing again and again), and leave.

        The others see it in join() and give up at once instead of waiting for this rank. This rank stays in
        the epoch (so it is kept, and still open to ranks starting late) until every other rank has
        entered it, or FAILURE_NOTICE_S has passed; those that entered see the news before they leave it.
        """
        with self._locked_state() as state:
            epoch = state.epochs.get(number)
            if epoch is None:
                return
            epoch.failed = LoadFailure(self.pid, message)
        deadline = time.monotonic() + FAILURE_NOTICE_S
        while time.monotonic() < deadline:
            epoch = self._peek_state().epochs.get(number)
            if epoch is None or len(epoch.entered) == self.world_size:
                break
            time.sleep(0.05)
        self.leave(number)

    def _peek_state(self) -> AreaState:
        """The state as last written (by atomic rename), read without the lock; creates nothing if the area is gone."""
        return AreaState.read(self._state_path)

    def _leave_locked(self, state: AreaState, number: int) -> None:
        epoch = state.epochs.get(number)
        if epoch is None:
            return
        if epoch.members.get(self.rank) == self.pid:
            del epoch.members[self.rank]
        if not epoch.members:
            self._forget(state, number)

    def leave(self, number: int) -> None:
        """Leave an epoch; the last member to leave removes its files (and the area, if nothing is left)."""
        with self._locked_state() as state:
            self._leave_locked(state, number)
            self._remove_dead_epochs(state)
            empty = not state.epochs
        if empty:
            with self._lock():
                if self._state_path.exists() and not AreaState.read(self._state_path).epochs:
                    shutil.rmtree(self.directory, ignore_errors=True)
