"""A test's own family, "tiny_crashing": the tiny transformer, except that a request whose first value is POISON
kills the rank's worker as a segfault in a kernel would (every rank sees the same input, so every rank dies).

The backend carries no test hook for this: the family reaches the build and the server's processes as a user's
family does, through the `mdtriton.families` entry point group (the `crashing_family` fixture in
tests/backend/conftest.py writes the dist-info that declares it; tests/families/ shows the mechanism).
"""

from __future__ import annotations

import signal

import torch

from mdtriton.families.tiny_transformer import TinyTransformer, TinyTransformerFamily

POISON = 1234.5


class CrashingTinyTransformer(TinyTransformer):
    def forward(self, hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        first = hidden_states.reshape(-1)
        if first.numel() and float(first[0]) == POISON:
            # Raised in the thread that runs the job, as a kernel's segfault is.
            signal.raise_signal(signal.SIGSEGV)
        return super().forward(hidden_states)


class CrashingTinyFamily(TinyTransformerFamily):
    name = "tiny_crashing"
    description = "the tiny transformer, crashing on a poison request (a test's own family)"
    module_class = CrashingTinyTransformer


CRASHING_TINY = CrashingTinyFamily()
