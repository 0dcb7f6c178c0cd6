"""What a running tritonserver holds, read from /proc: its stub processes (by instance name), their rank workers,
threads, memory."""

from __future__ import annotations

import json
import os
import resource
import time
from contextlib import contextmanager
from pathlib import Path

from mdtriton.backend.process_state import ProcessState, process_state
from mdtriton.backend.rendezvous_state import STATE_FILE, AreaState
from mdtriton.backend.worker_keeper import is_rank_worker


def stub_processes(server_pid: int) -> dict[str, int]:
    """The live Python backend stubs started by the server: "MODEL/VERSION/INSTANCE" (e.g. "tiny/1/rank_1") -> pid
    ("MODEL/VERSION/INSTANCE@PID" for a second instance of the same name, as Triton names GPU instances)."""
    stubs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            arguments = [a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        state, parent = fields[0], int(fields[1])
        if parent == server_pid and state != "Z" and arguments and arguments[0].endswith("triton_python_backend_stub"):
            # Arguments: stub, .../MODEL/VERSION/model.py, shm region, sizes, parent pid, ..., instance name, runtime.
            model_file = Path(arguments[1])
            name = f"{model_file.parent.parent.name}/{model_file.parent.name}/{arguments[-2]}"
            # KIND_GPU instances of a group share their name, one per GPU: tell them apart by pid.
            stubs[name if name not in stubs else f"{name}@{entry.name}"] = int(entry.name)
    return stubs


def children(pid: int) -> list[int]:
    """The live (not zombie) child processes of pid."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def rank_workers(server_pid: int) -> dict[str, list[int]]:
    """The rank worker processes of each live stub of the server (backend/rank_worker.py), by the stub's name (as
    stub_processes names them): a stub holds one, none while it starts a new one."""
    workers = {}
    for name, stub in stub_processes(server_pid).items():
        workers[name] = [pid for pid in children(stub) if is_rank_worker(pid)]
    return workers


def worker_rank(pid: int) -> int:
    """The rank a worker serves, from its command line (python -m mdtriton.backend.rank_worker SPEC_JSON ...)."""
    arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return json.loads(arguments[arguments.index(b"mdtriton.backend.rank_worker") + 1])["rank"]


def still_running(pids: set[int], timeout: float) -> set[int]:
    """The pids still running (not exited, not zombies) after waiting up to timeout for them all to end."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {pid for pid in pids if process_state(pid) is not ProcessState.EXITED}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def wait_for_stubs(server_pid: int, count: int, timeout: float = 60.0) -> dict[str, int]:
    """Wait until the server has exactly `count` live stubs; return them (whatever they are at the timeout)."""
    deadline = time.monotonic() + timeout
    stubs = stub_processes(server_pid)
    while len(stubs) != count and time.monotonic() < deadline:
        time.sleep(0.1)
        stubs = stub_processes(server_pid)
    return stubs


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def rss_bytes(pids) -> int:
    """Resident memory of the processes together (VmRSS)."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def data_size(pid: int) -> int:
    """The process's private writable memory (VmData), which RLIMIT_DATA bounds."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))


@contextmanager
def memory_capped(pid: int, headroom: int):
    """Let process pid allocate only `headroom` more bytes (RLIMIT_DATA) inside the block: its next large
    allocation fails as an out-of-memory would (a rank worker that fails a job exits: then there is nothing to undo)."""
    limit = resource.prlimit(pid, resource.RLIMIT_DATA)
    resource.prlimit(pid, resource.RLIMIT_DATA, (data_size(pid) + headroom, limit[1]))
    try:
        yield
    finally:
        try:
            resource.prlimit(pid, resource.RLIMIT_DATA, limit)
        except ProcessLookupError:
            pass


def files_under(directory: Path) -> list[str]:
    """Every file and folder left under directory (relative paths), [] if it does not exist."""
    if not directory.exists():
        return []
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


def rank_pids(rendezvous_root: Path) -> dict[int, int]:
    """rank -> pid of the newest epoch's members in the rendezvous areas under rendezvous_root."""
    states = [AreaState.read(path) for path in rendezvous_root.rglob(STATE_FILE)]
    newest = max((epoch for state in states for epoch in state.epochs.values()),
                 key=lambda epoch: len(epoch.members))
    return dict(newest.members)
