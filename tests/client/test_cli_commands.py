"""Every client command of `mdtriton` against the shared server, and every kind of failure as one line."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mdtriton.cli import main
from tests.served_models import FLUX_CONFIG, tiny_reference


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_health(served_models, capsys):
    code, out, _ = run(capsys, "health", "tiny", "--url", served_models.grpc_address)
    assert code == 0
    assert f"server {served_models.grpc_address}: live, ready (Triton 2.51.0)" in out and "model tiny: ready" in out


def test_metadata_tells_the_parallel_plan(served_models, capsys):
    code, out, _ = run(capsys, "metadata", "flux", "--url", served_models.grpc_address)
    assert code == 0
    assert "architecture flux, FP32, parallel plan: world 2 = tp 1 x cp 2 (ring)" in out
    assert "KIND_CPU, count 2" in out and "warm-up: all_ranks_together" in out
    assert "hidden_states" in out and "[-1, -1, 8]" in out and "txt_ids" in out
    code, out, _ = run(capsys, "metadata", "tiny", "--url", served_models.grpc_address)
    assert "versions served: 1, 2; version policy: all versions" in out


def test_models_lists_the_repository(served_models, capsys):
    code, out, _ = run(capsys, "models", "--url", served_models.grpc_address)
    assert code == 0
    rows = [line.split()[:3] for line in out.splitlines()[1:]]
    assert rows == [["flux", "1", "READY"], ["tiny", "1", "READY"], ["tiny", "2", "READY"]]


def test_infer_from_npy_and_safetensors_files(served_models, capsys, tmp_path):
    x = np.random.default_rng(0).standard_normal((1, 4, 64), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    save_file({"hidden_states": torch.from_numpy(x)}, tmp_path / "x.safetensors")
    expected = tiny_reference("2", torch.from_numpy(x)).numpy()
    for source, output in ((f"hidden_states={tmp_path / 'x.npy'}", tmp_path / "out"),
                           (str(tmp_path / "x.safetensors"), tmp_path / "out.safetensors")):
        code, out, err = run(capsys, "infer", "tiny", "--url", served_models.grpc_address, "--model-version", "2",
                             "--input", source, "--output", str(output))
        assert code == 0, err
        assert "output: float32 [1, 4, 64]" in out and "latency:" in out
    saved_npy = np.load(tmp_path / "out" / "output.npy")
    saved_safetensors = load_file(tmp_path / "out.safetensors")["output"].numpy()
    assert np.abs(saved_npy - expected).max() < 1e-5
    np.testing.assert_array_equal(saved_npy, saved_safetensors)


def test_infer_many_requests_concurrently(served_models, capsys, tmp_path):
    np.save(tmp_path / "x.npy", np.ones((1, 3, 64), np.float32))
    code, out, err = run(capsys, "infer", "tiny", "--url", served_models.grpc_address, "--input",
                         f"hidden_states={tmp_path / 'x.npy'}", "--requests", "8", "--concurrency", "4")
    assert code == 0, err
    assert "8 requests, concurrency 4:" in out and "requests/s" in out


def test_sample_saves_latents(served_models, capsys, tmp_path):
    save_file({"encoder_hidden_states": torch.randn(1, 6, FLUX_CONFIG["joint_attention_dim"]),
               "pooled_projections": torch.randn(1, FLUX_CONFIG["pooled_projection_dim"])}, tmp_path / "prompt.safetensors")
    code, out, err = run(capsys, "sample", "flux", "--url", served_models.grpc_address, "--input",
                         str(tmp_path / "prompt.safetensors"), "--height", "64", "--width", "32", "--steps", "3",
                         "--output", str(tmp_path / "latents.safetensors"))
    assert code == 0, err
    latents = load_file(tmp_path / "latents.safetensors")["latents"]
    assert latents.shape == (1, 4 * 2, FLUX_CONFIG["in_channels"]) and torch.isfinite(latents).all()
    assert "3 steps in" in out and "denoising" in err  # the progress bar


@pytest.mark.parametrize("args, message", [
    (["infer", "nosuch", "--input", "hidden_states=X"], "model 'nosuch': NOT_FOUND: Request for unknown model: 'nosuch' is not found"),
    (["infer", "tiny", "--model-version", "7", "--input", "hidden_states=X"], "'tiny' version 7 is not found"),
    (["infer", "tiny", "--input", "hidden_states=BAD"], "INVALID_ARGUMENT"),
    (["infer", "tiny", "--input", "wrong_name=X"], "has no input(s) ['wrong_name']"),
    (["infer", "tiny", "--input", "hidden_states=/no/such/file.npy"], "No such file or directory"),
    (["infer", "tiny", "--input", "X"], "a .npy file holds no name: give NAME="),
    (["health", "nosuch"], "model nosuch: NOT ready"),
    (["metadata", "nosuch"], "model 'nosuch': NOT_FOUND"),
    (["load", "tiny"], "load 'tiny': the server takes no load/unload requests; start it with --model-control-mode explicit"),
    (["unload", "tiny"], "unload 'tiny': the server takes no load/unload requests"),
    (["sample", "tiny", "--input", "X.safetensors"], "sample needs --input for ['encoder_hidden_states', 'pooled_projections']"),
])
def test_every_failure_is_one_line_and_exit_code_1(served_models, capsys, tmp_path, args, message):
    np.save(tmp_path / "x.npy", np.ones((1, 3, 64), np.float32))
    np.save(tmp_path / "bad.npy", np.ones((1, 3, 32), np.float32))
    save_file({"hidden_states": torch.ones(1, 3, 64)}, tmp_path / "x.safetensors")
    paths = {"X": str(tmp_path / "x.npy"), "BAD": str(tmp_path / "bad.npy"), "X.safetensors": str(tmp_path / "x.safetensors")}
    args = [paths.get(a, a.replace("=X", f"={paths['X']}").replace("=BAD", f"={paths['BAD']}")) for a in args]
    code, out, err = run(capsys, *args, "--url", served_models.grpc_address, "--retries", "0")
    assert code == 1
    text = err or out  # health reports "NOT ready" on stdout
    assert message in text, text
    if err:
        assert err.startswith("error: ") and err.count("\n") == 1


def test_unreachable_server_from_a_real_process_is_one_line():
    result = subprocess.run([sys.executable, "-m", "mdtriton.cli", "models", "--url", "127.0.0.1:1", "--retries", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith("error: repository index: no Triton server answers at 127.0.0.1:1")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
