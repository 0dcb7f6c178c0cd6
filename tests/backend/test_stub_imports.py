"""A rank's stub (backend/rank_model.py) imports none of the engine's modules by itself: the worker's spec, the
messages and the request checks it needs live apart from the engine; and its family lookup at load, which imports
every family's modules, imports none of torch's compiler (docs/architecture.md, "Serving")."""

from __future__ import annotations

import subprocess
import sys

ENGINE_MODULES = ("mdtriton.engine.engine", "mdtriton.engine.attention", "mdtriton.engine.compile")
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


def test_a_stub_imports_no_engine_module_and_its_family_lookup_no_compiler():
    after_import, after_lookup = subprocess.run([sys.executable, "-c", LOAD_AS_A_STUB], capture_output=True,
                                                text=True, check=True, timeout=120).stdout.splitlines()
    assert "mdtriton.backend.rank_model" in after_import.split()
    assert not [name for name in after_import.split() if name.startswith(ENGINE_MODULES + COMPILER_MODULES)]
    assert "mdtriton.families.flux" in after_lookup.split()
    assert not [name for name in after_lookup.split() if name.startswith(COMPILER_MODULES)]
