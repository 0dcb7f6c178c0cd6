"""Install Triton's perf_analyzer as a `perf_analyzer` command next to this Python.

PyPI's perf-analyzer wheels (2.58+) are built for glibc 2.38 or newer. Where glibc is that new, this
pip-installs `perf-analyzer`. Elsewhere (Debian 12 has 2.36) it takes the perf_analyzer binary that
the tritonclient 2.51.0 wheel carries (the Triton SDK of the same release as our embedded server),
downloaded with pip, and writes a wrapper that finds the two libraries it needs (libb64, libcudart 12)
among those of the nvidia-pytriton wheel, which is installed here anyway.

    python3 benchmarks/install_perf_analyzer.py
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from mdtriton.server import triton_dir

PYPI_VERSION = "2.60.0"
SDK_WHEEL = "tritonclient==2.51.0"
SDK_BINARY = "tritonclient-2.51.0.data/data/bin/perf_analyzer"
# The library names perf_analyzer asks for -> how they start in nvidia_pytriton.libs (auditwheel-renamed).
LIBRARIES = {"libb64.so.0d": "libb64-", "libcudart.so.12": "libcudart-"}


def glibc_at_least(major: int, minor: int) -> bool:
    name, version = platform.libc_ver()
    return name == "glibc" and tuple(int(p) for p in version.split(".")[:2]) >= (major, minor)


def install_sdk_binary(scripts: Path) -> Path:
    home = Path(sys.prefix) / "lib" / "mdtriton-perf-analyzer"
    libs = home / "lib"
    libs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", SDK_WHEEL, "-d", download],
                       check=True)
        wheel = next(Path(download).glob("tritonclient-*.whl"))
        with zipfile.ZipFile(wheel) as archive, archive.open(SDK_BINARY) as source, \
                open(home / "perf_analyzer", "wb") as target:
            shutil.copyfileobj(source, target)
    (home / "perf_analyzer").chmod(0o755)
    pytriton_libs = triton_dir().parent.parent / "nvidia_pytriton.libs"
    for name, prefix in LIBRARIES.items():
        found = sorted(pytriton_libs.glob(prefix + "*"))
        if not found:
            raise SystemExit(f"{pytriton_libs} has no {prefix}*: install nvidia-pytriton==0.7.0 first")
        link = libs / name
        link.unlink(missing_ok=True)
        link.symlink_to(found[0])
    wrapper = scripts / "perf_analyzer"
    wrapper.write_text("#!/bin/sh\n"
                       f'LD_LIBRARY_PATH="{libs}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec "{home / "perf_analyzer"}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    scripts = Path(sysconfig.get_paths()["scripts"])
    if glibc_at_least(2, 38):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"perf-analyzer=={PYPI_VERSION}"], check=True)
        command = shutil.which("perf_analyzer", path=str(scripts)) or "perf_analyzer"
    else:
        command = str(install_sdk_binary(scripts))
    version = subprocess.run([command, "--version"], capture_output=True, text=True, env=os.environ)
    print(f"installed {command}: {version.stdout.strip() or version.stderr.strip()}")
    return version.returncode


if __name__ == "__main__":
    sys.exit(main())
