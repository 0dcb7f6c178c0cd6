"""End this stub process where Triton 2.51's Python backend would go wrong: when the stub comes back from being
frozen (SIGSTOP, a debugger) for seconds, and when its server process has gone.

Frozen: Triton 2.51 declares a stub that does not answer for about a second unhealthy and fails the request it sent
there; when the stub is continued and the next request reaches it, the whole tritonserver aborts
(boost::interprocess::lock_exception, seen here). A stub that exits instead leaves a dead rank, which the other ranks
report in every answer and a reload of the model replaces. The cost: a rank frozen for longer than FROZEN_LIMIT_S is
lost even if it would have come back.

Server gone (SIGKILL of tritonserver): the stub's own health thread notices and exits, but it first takes the lock
that a thread sending the server a message (a metric update) holds while it waits for the dead server's answer, so the
stub hung for ever, and so did its rank worker (seen here: the worker keeper records job times up to 0.2 s after a
job). This watchdog ends the stub instead; its rank worker follows it (PR_SET_PDEATHSIG, backend/rank_worker.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

# Triton waits about 1 s for a stub's health flag; a thread of ours that did not run for twice that
# long means the whole process was frozen (a busy process still runs this thread every few ms).
FROZEN_LIMIT_S = 2.0
TICK_S = 0.1


class StubWatchdog:
    """A thread that ticks every TICK_S: on_freeze(seconds) runs when a tick comes FROZEN_LIMIT_S late, on_server_gone()
    when this process's parent (the server, when started) is no longer its parent."""

    def __init__(self, on_freeze: Callable[[float], None], on_server_gone: Callable[[], None]):
        self._on_freeze = on_freeze
        self._on_server_gone = on_server_gone
        self._server_pid = os.getppid()
        self._last_tick = time.monotonic()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mdtriton-stub-watchdog", daemon=True)

    def start(self) -> "StubWatchdog":
        self._last_tick = time.monotonic()
        self._thread.start()
        return self

    def check(self) -> None:
        """Call on_freeze now if the ticks stopped: lets a request that arrives first after a freeze see it."""
        frozen = time.monotonic() - self._last_tick
        if frozen > FROZEN_LIMIT_S:
            self._on_freeze(frozen)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(TICK_S):
            self.check()
            if os.getppid() != self._server_pid:  # the server died: this process now belongs to init (or a subreaper)
                self._on_server_gone()
            self._last_tick = time.monotonic()
