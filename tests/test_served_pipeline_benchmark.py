"""benchmarks/served_pipeline.py --tiny on CPU ranks (gloo), as its users run it: a named pipeline served with
diffusers' own transformer (FLUX.2 [klein] with an input image) on 2 ranks, and diffusers' own pipeline beside it on the
same directory, request and seed: their images agree within 1 uint8 level (float32), so the benchmark's request and its
peer's are the same request. The other new architectures (qwen-image-edit-plus, flux2, ltx2) run the same script: see
its --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(400)
def test_tiny_flux2_klein_served_on_2_ranks_agrees_with_diffusers_pipeline(tmp_path):
    rows_file = tmp_path / "rows.jsonl"
    command = [sys.executable, ROOT / "benchmarks" / "served_pipeline.py", "--tiny", "--architecture", "flux2-klein",
               "--input-images", "1", "--plans", "ulysses2", "--diffusers", "1", "--peers-eager", "--images", "1",
               "--concurrent", "0", "--workdir", tmp_path / "work", "--output", rows_file]
    # The checkout's mdtriton, not an installed one (the script's own folder is first on its path).
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=360,
                            env=environment, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [(row["plan"], row["gpus"], row["failed"]) for row in rows] == [("ulysses2", 2, 0), ("diffusers 1", 1, 0)]
    assert rows[1]["max_diff"] <= 1, rows[1]  # diffusers' image against the served one, same seed
    assert "flux2-klein pipeline (tiny), 64x64 from 1 input image of that size, 3 steps" in result.stdout
    assert "| ulysses2 (world 2 = tp 1 x cp 2 (ulysses)) | FP32 |" in result.stdout
