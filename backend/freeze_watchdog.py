"""End this stub process when it comes back from being frozen (SIGSTOP, a debugger) for seconds.

Why: Triton 2.51's Python backend declares a stub that does not answer for about a second unhealthy
and fails the request it sent there; when the stub is continued and the next request reaches it, the
whole tritonserver aborts (boost::interprocess::lock_exception, seen here). A stub that exits instead
leaves a dead rank, which the other ranks report in every answer and a reload of the model replaces.
The cost: a rank frozen for longer than FROZEN_LIMIT_S is lost even if it would have come back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# Triton waits about 1 s for a stub's health flag; a thread of ours that did not run for twice that
# long means the whole process was frozen (a busy process still runs this thread every few ms).
FROZEN_LIMIT_S = 2.0
TICK_S = 0.1


class FreezeWatchdog:
    """A thread that ticks every TICK_S; on_freeze(seconds) runs when a tick comes FROZEN_LIMIT_S late."""

    def __init__(self, on_freeze: Callable[[float], None]):
        self._on_freeze = on_freeze
        self._last_tick = time.monotonic()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mdtriton-freeze-watchdog", daemon=True)

    def start(self) -> "FreezeWatchdog":
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
            self._last_tick = time.monotonic()
