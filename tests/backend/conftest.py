"""Fixtures of the backend tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mdtriton.families import families

CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.fixture
def crashing_family(tmp_path, monkeypatch):
    """The "tiny_crashing" family (tests/backend/crashing_family.py) registered for this process, the build and the
    server's stubs and workers: its entry point in a dist-info on PYTHONPATH, with the checkout (for `tests`)."""
    package = tmp_path / "crashing_package"
    info = package / "mdtriton_crashing_tiny-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mdtriton-crashing-tiny\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[mdtriton.families]\ntiny_crashing = tests.backend.crashing_family:CRASHING_TINY\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(package), str(CHECKOUT)]
                                                     + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    monkeypatch.syspath_prepend(str(package))
    families.cache_clear()
    yield "tiny_crashing"
    families.cache_clear()
