"""`mdtriton bench --device cpu`, the tool's check on CPU ranks (gloo), for every family it measures: each plan's
forward equals the 1-rank one, the sizes become the pipeline's requests, and bad sizes are refused in one line; and
how it sums a profiled forward's kernels on GPUs."""

from __future__ import annotations

import json

import pytest

from mdtriton.bench import benchmarked_architectures, kernel_timeline, kernels_summary, kinds_table
from mdtriton.cli import main

# (architecture, sizes as --height --width --frames, the tokens each becomes)
RUNS = {"flux": (["--height", "64,32", "--width", "64,48", "--frames", "1"], [16 + 512, 6 + 512]),
        "wan": (["--height", "32", "--width", "48", "--frames", "9"], [3 * 2 * 3]),
        "cosmos3": (["--height", "32", "--width", "48", "--frames", "9"], [3 * 1 * 2 + 256])}


def test_every_family_with_sized_requests_is_measured():
    assert set(benchmarked_architectures()) == set(RUNS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("architecture", sorted(RUNS))
def test_bench_on_cpu_ranks_measures_each_plan_against_one_rank(architecture, tmp_path):
    sizes, tokens = RUNS[architecture]
    assert main(["bench", "--architecture", architecture, "--device", "cpu", "--preset", "tiny", "--gpus", "1,2",
                 "--methods", "ulysses,tp", "--variants", "compiled", "--warmup", "0", "--iterations", "1",
                 "--output-dir", str(tmp_path), *sizes]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["architecture"], results["preset"]) == (architecture, "tiny")
    rows = results["forward"]
    assert {(row["gpus"], row["method"]) for row in rows} == {(1, "1 GPU"), (2, "ulysses"), (2, "tp")}
    assert sorted({row["tokens"] for row in rows}) == sorted(tokens)
    checked = [row for row in rows if "error_vs_1gpu" in row]
    assert len(checked) == 3 and all(row["tokens"] == tokens[0] for row in checked)
    for row in checked:
        assert row["error_vs_1gpu"] < 1e-5, row  # float32 ranks: the same forward, split
        assert row["error_vs_float32"] < 1e-2, row  # against the same weights rounded to bf16
    assert "One block's attention alone" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "speedup.png").stat().st_size > 0


@pytest.mark.timeout(600)
def test_bench_on_cpu_ranks_with_its_defaults_skips_fp8_saying_so(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--preset", "tiny", "--gpus", "1", "--height", "32", "--width", "48",
                 "--warmup", "0", "--iterations", "1", "--output-dir", str(tmp_path)]) == 0
    assert "skipped the fp8 variant: FP8 engines run on NVIDIA GPUs" in capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())["forward"]
    assert sorted(row["variant"] for row in rows) == ["compiled", "eager"]


@pytest.mark.timeout(600)
def test_bench_of_the_eager_variant_alone_measures_against_its_own_one_rank_forward(tmp_path):
    assert main(["bench", "--device", "cpu", "--preset", "tiny", "--gpus", "1,2", "--methods", "tp", "--variants",
                 "eager", "--height", "32", "--width", "48", "--warmup", "0", "--iterations", "1",
                 "--output-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["forward"]
    assert {(row["gpus"], row["variant"]) for row in rows} == {(1, "eager"), (2, "eager")}
    assert all(row["error_vs_1gpu"] < 1e-5 for row in rows)
    assert "rel. error vs 1 GPU eager / vs float32" in (tmp_path / "results.md").read_text()


def test_fp8_asked_for_where_it_cannot_run_is_refused_in_one_line(capsys):
    assert main(["bench", "--device", "cpu", "--preset", "tiny", "--gpus", "1", "--variants", "compiled,fp8"]) == 1
    assert "FP8 engines run on NVIDIA GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("architecture, sizes, message", [
    ("wan", ["--height", "480", "--width", "832", "--frames", "80"], "80 frames is not 4k+1"),
    ("wan", ["--height", "488", "--width", "832", "--frames", "81"], "height 488 is not a positive multiple of 16"),
    ("flux", ["--height", "1024", "--width", "1024", "--frames", "5"], "FLUX makes images"),
    ("flux", ["--height", "1024,2048", "--width", "1024"], "one width per height"),
    ("cosmos3", ["--height", "720", "--width", "1280", "--frames", "188"], "188 frames is not 4k+1"),
])
def test_bad_sizes_are_refused_before_any_rank_starts(architecture, sizes, message, capsys):
    assert main(["bench", "--architecture", architecture, "--device", "cpu", "--preset", "tiny", "--gpus", "1",
                 "--variants", "compiled", *sizes]) == 1
    assert message in capsys.readouterr().err


def test_the_kernel_timeline_counts_communication_no_compute_hid_and_time_no_kernel_ran():
    # (start, end in microseconds, NCCL's): half of the first transfer runs beside compute, then alone; a gap; the
    # second transfer runs wholly beside compute.
    kernels = [(0, 10, False), (5, 15, True), (20, 30, False), (22, 24, True)]
    timeline = kernel_timeline(kernels)
    assert timeline["communication_share"] == pytest.approx(12 / 32)
    assert timeline["exposed_ms"] == pytest.approx(0.005)
    assert timeline["idle_ms"] == pytest.approx(0.005)
    assert kernel_timeline(kernels[::-1]) == timeline  # as the profiler lists them, in any order
    assert kernel_timeline([]) == {"communication_share": 0.0, "exposed_ms": 0.0, "idle_ms": 0.0}


def test_the_kernels_summary_sums_a_ranks_kernels_by_kind_and_its_timeline():
    # (name, start, end in microseconds), one rank: a transfer half beside a GEMM, then a Triton kernel after a gap
    kernels = [("ncclDevKernel_SendRecv", 0, 100), ("sm90_xmma_gemm_bf16", 50, 250), ("triton_poi_fused_add", 300, 350)]
    summary = kernels_summary(kernels)
    assert summary["exposed_ms"] == [pytest.approx(0.05)] and summary["idle_ms"] == [pytest.approx(0.05)]
    assert summary["compute_ms"] == [pytest.approx(0.25)]
    assert summary["kernel_ms_by_kind"] == pytest.approx(
        {"NCCL": 0.1, "attention": 0.0, "gemm": 0.2, "fused (Triton)": 0.05, "copy": 0.0, "other": 0.0})


def test_the_kinds_table_holds_each_ranks_kernels_against_its_share_of_one_gpus():
    kinds = {"NCCL": 0.0, "attention": 40.0, "gemm": 80.0, "fused (Triton)": 8.0, "copy": 0.0, "other": 2.0}
    row = {"size": "1024x1024", "tokens": 4608, "variant": "compiled", "gpus": 1, "method": "1 GPU",
           "kernel_ms_by_kind": kinds}
    four = {**row, "gpus": 4, "method": "ulysses",
            "kernel_ms_by_kind": {**kinds, "NCCL": 9.0, "attention": 10.0, "gemm": 25.0, "copy": 1.5, "other": 0.5}}
    lines = kinds_table([four, row]).splitlines()
    assert lines[-3].endswith("| 0.0 | 40.0 | 80.0 | 8.0 | 0.0 | 2.0 | 130.0 |")
    # the rank's attention is an even share, its GEMMs 1.25x theirs; no share where one GPU ran none (copy, NCCL)
    assert lines[-2].endswith("| 9.0 | 10.0 (1.00x) | 25.0 (1.25x) | 8.0 (4.00x) | 1.5 | 0.5 (1.00x) | 45.0 (1.38x) |")
    assert kinds_table([{**row, "kernel_ms_by_kind": {}}]) == ""  # CPU ranks: nothing profiled
