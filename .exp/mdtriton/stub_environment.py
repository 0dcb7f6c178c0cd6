"""The Python environment the embedded Triton 2.51's Python-backend stubs run in: this one, with numpy 1.26 first.

The 2.51 stub was built with pybind11 2.10, which reads numpy 2's dtypes wrongly: the first request with a BYTES
(TYPE_STRING) input kills the stub before `execute` runs (fixed in Triton 2.52 by python_backend PR #384,
pybind11 2.12). A stub's site-packages follow the `python3` first on PATH, so the embedded server puts a small
virtual environment first there: its own site-packages hold numpy 1.26, and a .pth file after it names this
interpreter's site-packages (torch, mdtriton and the rest: the packages of the environment the server is started
from, which need not be the base interpreter's, as in a venv). PYTHONPATH comes after these (backend/rank_model.py
appends it to the stub's sys.path: the stub does not read it). The rank workers the stubs start put PYTHONPATH first,
so they keep numpy 2. The model repository is not touched: the same repository serves on a stock Triton (2.52 and
later need none of this).

It is made once per Python environment under ~/.cache/mdtriton (XDG_CACHE_HOME), with pip from the package index
(PIP_INDEX_URL, or PIP_NO_INDEX with PIP_FIND_LINKS on a host without one).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import site
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

NUMPY = "numpy==1.26.4"  # the last numpy 1, with wheels for Python 3.9 to 3.12


class StubEnvironmentError(Exception):
    """The stubs' environment could not be made."""


def stub_environment() -> Path:
    """The stubs' virtual environment (its bin/ goes first on the server's PATH), made on first use."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mdtriton"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    environment = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    target = cache / f"stub-env-py{version}-{NUMPY.replace('==', '-')}-{environment}"
    if target.is_dir():  # complete: a new one is made aside and renamed into place
        return target
    cache.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache))
    try:
        print(f"mdtriton: making the Python environment of Triton 2.51's stubs ({NUMPY}, once) in {target}",
              file=sys.stderr, flush=True)
        venv.create(building, with_pip=False, symlinks=True)
        site_packages = building / "lib" / f"python{version}" / "site-packages"
        (site_packages / "mdtriton-server-environment.pth").write_text("\n".join(packages_of_this_environment()) + "\n")
        result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                 "--no-deps", "--only-binary=:all:", "--target", str(site_packages), NUMPY],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise StubEnvironmentError(
                f"could not install {NUMPY} for Triton 2.51's Python-backend stubs (their pybind11 cannot read BYTES "
                f"inputs under numpy 2); pip said: {result.stderr.strip()[-600:]}. On a host without a package index, "
                f"point PIP_NO_INDEX=1 and PIP_FIND_LINKS=DIR at a directory holding numpy 1.26.4's wheel")
        try:
            building.rename(target)
        except OSError:  # another process made it first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def packages_of_this_environment() -> list[str]:
    """This interpreter's site-packages directories, the user's included where Python reads it."""
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    return site.getsitepackages() + user
