"""Run Python code as another local user (uid 65534, "nobody"), as a hostile neighbour of the server would.

The tests run as root here and in CI; `setpriv` (util-linux) switches to the other uid. The code gets the
standard library only (the test environment's packages may lie where that user cannot read them): it talks to
the server over HTTP with urllib and reads files with open().
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

OTHER_UID = 65534
SETPRIV = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]


def other_user_python() -> list[str]:
    """The command that runs `python3 -c CODE` as uid 65534; skips the test where that is not possible."""
    if os.geteuid() != 0:
        pytest.skip("running code as another user (uid 65534) needs root: the tests run as uid " + str(os.geteuid()))
    if shutil.which("setpriv") is None:
        pytest.skip("running code as another user needs setpriv (util-linux), which is not installed")
    for python in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        if python and subprocess.run(SETPRIV + [python, "-c", "import json, urllib.request"],
                                     capture_output=True).returncode == 0:
            return SETPRIV + [python]
    pytest.skip(f"no Python that uid {OTHER_UID} may run (setpriv as uid {OTHER_UID} failed for {sys.executable})")


def run_as_other_user(code: str, *arguments: str, timeout: float = 60) -> dict:
    """Run code as uid 65534 with sys.argv[1:] = arguments; it prints one JSON object, returned here."""
    done = subprocess.run(other_user_python() + ["-c", code, *arguments], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"the other user's code failed:\n{done.stderr}"
    return json.loads(done.stdout)
