"""Triton's perf_analyzer against a served mdtriton model over gRPC (installed by
benchmarks/install_perf_analyzer.py; .ci/run does that)."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sysconfig

import pytest


def perf_analyzer() -> str:
    """The perf_analyzer command: on PATH, or in this Python's scripts directory (pyenv puts no shim there)."""
    found = shutil.which("perf_analyzer", path=os.pathsep.join([sysconfig.get_paths()["scripts"],
                                                                os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail("perf_analyzer is not installed: run `python3 benchmarks/install_perf_analyzer.py`")
    return found


@pytest.mark.timeout(180)
def test_perf_analyzer_measures_the_served_model(served_models, tmp_path):
    report = tmp_path / "report.csv"
    command = [perf_analyzer(), "-m", "tiny", "-x", "2", "-u", served_models.grpc_address, "-i", "grpc",
               "--shape", "hidden_states:1,16,64", "--input-data", "zero", "--concurrency-range", "2",
               "--measurement-mode", "count_windows", "--measurement-request-count", "10",
               "--stability-percentage", "100", "-f", str(report)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Concurrency: 2, throughput:" in result.stdout
    row = next(csv.DictReader(report.open()))
    assert float(row["Inferences/Second"]) > 0 and int(row["Concurrency"]) == 2
