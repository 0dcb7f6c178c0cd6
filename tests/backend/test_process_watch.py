"""Telling a stopped rank from an exited one (/proc), and the stub watchdog that ends a stub coming back from SIGSTOP
or outliving its server."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from mdtriton.backend.process_state import ProcessState, describe_ranks, process_state

WATCHED = """
import os, sys, time
from mdtriton.backend.stub_watchdog import StubWatchdog
StubWatchdog(lambda seconds: os._exit(3), lambda: os._exit(4)).start()
print("watching", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    sum(range(10000))  # a busy process still lets the watchdog tick
"""


def wait_for_state(pid: int, state: ProcessState, timeout: float = 5.0) -> ProcessState:
    deadline = time.monotonic() + timeout
    while process_state(pid) is not state and time.monotonic() < deadline:
        time.sleep(0.01)
    return process_state(pid)


def test_running_stopped_and_exited_processes_are_told_apart():
    process = subprocess.Popen(["sleep", "30"])
    try:
        assert process_state(process.pid) is ProcessState.RUNNING
        process.send_signal(signal.SIGSTOP)
        assert wait_for_state(process.pid, ProcessState.STOPPED) is ProcessState.STOPPED
        assert describe_ranks({0: 1, 1: process.pid}) == f"rank 1 (pid {process.pid}) is stopped (SIGSTOP or a debugger)"
        process.kill()  # not yet reaped: a zombie counts as exited
        assert wait_for_state(process.pid, ProcessState.EXITED) is ProcessState.EXITED
        assert "has exited" in describe_ranks({1: process.pid})
    finally:
        process.kill()
        process.wait()
    assert process_state(process.pid) is ProcessState.EXITED
    assert describe_ranks({0: process.pid}, exclude=0) == ""


@pytest.mark.timeout(60)
def test_stub_watchdog_ends_a_process_continued_after_a_stop_but_not_a_busy_one():
    busy = subprocess.Popen([sys.executable, "-c", WATCHED, "3"], stdout=subprocess.PIPE, text=True)
    assert busy.stdout.readline().strip() == "watching"
    assert busy.wait(30) == 0

    frozen = subprocess.Popen([sys.executable, "-c", WATCHED, "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert frozen.stdout.readline().strip() == "watching"
        frozen.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        frozen.send_signal(signal.SIGCONT)
        assert frozen.wait(5) == 3
    finally:
        frozen.kill()
        frozen.wait()


PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], "60"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.timeout(60)
def test_stub_watchdog_ends_a_process_whose_parent_was_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, WATCHED], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert process_state(child) is ProcessState.RUNNING
        parent.kill()
        parent.wait()
        # Busy for 60 s otherwise; reparented, it is reaped by init (or a subreaper) once it exits.
        assert wait_for_state(child, ProcessState.EXITED, timeout=5) is ProcessState.EXITED
    finally:
        parent.kill()
        parent.wait()
