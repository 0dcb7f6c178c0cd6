"""A rank's stub (backend/rank_model.py) never imports torch's compiler (1.5 s of its CPU): neither by its own modules
nor by its family lookup at load, which imports every family's modules and, with them, the engine's; the attention
methods import the compiler at their first call, which a stub never makes (docs/architecture.md, "Serving")."""

from __future__ import annotations

import subprocess
import sys

COMPILER_MODULES = ("torch._dynamo", "torch._inductor")
# As Triton's stub imports model.py (triton_python_backend_utils exists only inside the stub: a stand-in), then the
# lookup RankModel makes at load, for every family.
LOAD_AS_A_STUB = """
import sys, types
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
import mdtriton.backend.rank_model
print(" ".join(sorted(sys.modules)))
from mdtriton.families import families
families()
print(" ".join(sorted(sys.modules)))
"""


def test_a_stub_and_its_family_lookup_import_no_compiler():
    after_import, after_lookup = subprocess.run([sys.executable, "-c", LOAD_AS_A_STUB], capture_output=True,
                                                text=True, check=True, timeout=120).stdout.splitlines()
    assert "mdtriton.backend.rank_model" in after_import.split()
    assert not [name for name in after_import.split() if name.startswith(COMPILER_MODULES)]
    assert {"mdtriton.families.flux", "mdtriton.engine.engine"} <= set(after_lookup.split())
    assert not [name for name in after_lookup.split() if name.startswith(COMPILER_MODULES)]
