"""A rank's stub (backend/rank_model.py) imports none of the engine's modules by itself: the worker's spec, the
messages and the request checks it needs live apart from the engine (docs/architecture.md, "Serving")."""

from __future__ import annotations

import subprocess
import sys

ENGINE_MODULES = ("mdtriton.engine.engine", "mdtriton.engine.attention", "mdtriton.engine.compile", "torch._dynamo",
                  "torch._inductor")
# As Triton's stub imports model.py: triton_python_backend_utils exists only inside the stub, so a stand-in.
IMPORT_AS_A_STUB = """
import sys, types
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
import mdtriton.backend.rank_model
print("\\n".join(sorted(sys.modules)))
"""


def test_the_stub_imports_no_engine_module():
    imported = subprocess.run([sys.executable, "-c", IMPORT_AS_A_STUB], capture_output=True, text=True, check=True,
                              timeout=120).stdout.split()
    assert "mdtriton.backend.rank_model" in imported
    assert not [name for name in imported if name.startswith(ENGINE_MODULES)]
