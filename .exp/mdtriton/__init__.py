"""mdtriton: one model served across N GPUs by NVIDIA Triton Inference Server."""

from pathlib import Path

__version__ = "0.1.0"

# Installed, backend/, build_tools/ and client/ are subpackages of mdtriton (pyproject maps them). In a
# source checkout they sit beside this directory; adding the checkout root to this package's path lets
# `mdtriton.backend` etc. import from there too (tests, PYTHONPATH=checkout, and the server's stubs).
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "backend" / "model.py").is_file():
    __path__.append(str(_checkout))
