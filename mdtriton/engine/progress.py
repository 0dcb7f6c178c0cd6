"""Progress of a long job (a denoising loop), reported from inside the engine to whoever waits for it.

The backend's job runner sets a listener around the engine call of a job whose request streams progress;
the engine calls `report_progress` after each step. A context variable keeps the engine interface as it is
(`forward(inputs)`) and lets ranks without a listener (every rank but the request's) report to nobody.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ProgressListener = Callable[[int, int], None]  # (steps done, steps in all)

_listener: contextvars.ContextVar[ProgressListener | None] = contextvars.ContextVar("mdtriton_progress", default=None)


@contextmanager
def progress_to(listener: ProgressListener | None) -> Iterator[None]:
    """Send the progress reported inside this block to listener (None: to nobody)."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


def report_progress(done: int, total: int) -> None:
    """Tell the current listener, if any, that done of total steps are finished."""
    listener = _listener.get()
    if listener is not None:
        listener(done, total)
