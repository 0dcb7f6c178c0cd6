"""Whether another rank's process is running, stopped or gone, read from /proc (all ranks share one host); and a
process's life tied to its parent's.

The ranks of a model are the worker processes of one Triton server's stubs, so a rank that stops answering
can be told apart: exited (killed or crashed; a zombie not yet reaped counts as exited), stopped (SIGSTOP or a
debugger), or running (alive but stuck, or slow).
"""

from __future__ import annotations

import ctypes
import os
import signal
from enum import Enum

PR_SET_PDEATHSIG = 1


class ProcessState(Enum):
    RUNNING = "running"
    STOPPED = "stopped"
    EXITED = "exited"


def process_state(pid: int) -> ProcessState:
    """The state of process pid, as the kernel reports it in /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # "pid (command) state ...": the command may hold spaces and parentheses, the state follows the last ")".
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return ProcessState.EXITED
    if state in ("Z", "X", "x"):
        return ProcessState.EXITED
    if state in ("T", "t"):
        return ProcessState.STOPPED
    return ProcessState.RUNNING


def describe_ranks(members: dict[int, int], exclude: int | None = None) -> str:
    """One phrase on the ranks (rank -> pid) that are not running, e.g. "rank 1 (pid 4977) has exited" ("" if
    all run)."""
    phrases = []
    for rank, pid in sorted(members.items()):
        if rank == exclude:
            continue
        state = process_state(pid)
        if state is ProcessState.EXITED:
            phrases.append(f"rank {rank} (pid {pid}) has exited (killed or crashed)")
        elif state is ProcessState.STOPPED:
            phrases.append(f"rank {rank} (pid {pid}) is stopped (SIGSTOP or a debugger)")
    return "; ".join(phrases)


def end_with_parent(parent_pid: int, sig: signal.Signals) -> None:
    """Have the kernel send this process sig when its parent exits, however it exits (SIGKILL too); exit at once if
    parent_pid has already gone (this process was handed to another parent before the request took effect)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:
        os._exit(1)
