"""The mdtriton command as a user runs it: build, serve (on Triton's usual ports where free; stopped by SIGTERM, nothing
left behind), infer; the client commands without torch."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from mdtriton.cli import main
from mdtriton.server import TRITON_PORTS
from mdtriton.testing.triton_processes import stub_processes


def mdtriton(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mdtriton.cli", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_every_command():
    result = mdtriton("--help")
    assert result.returncode == 0
    for command in ("build", "serve", "infer", "sample", "health", "metadata", "models", "load", "unload", "demo",
                    "lora"):
        assert command in result.stdout


def test_bad_arguments_give_one_clear_line(tmp_path):
    result = mdtriton("build", str(tmp_path), "--name", "m", "--config", "{not json")
    assert result.returncode != 0 and "--config is not valid JSON" in result.stderr


def test_generate_refuses_an_output_it_cannot_write_before_it_asks(tmp_path, capsys):
    """Checked before the request (no server here), so a long job is never lost at its end; the message names the
    path."""
    target = tmp_path / "no such directory" / "clip.mp4"
    assert main(["generate", "wan", "a cat", "--url", "127.0.0.1:1", "-o", str(target)]) == 1
    assert f"cannot write {target}: there is no directory {target.parent}" in capsys.readouterr().err


def test_the_client_commands_import_no_torch():
    """The client and the CLI's client commands work where torch is not installed (pip install mdtriton)."""
    code = ("import sys, mdtriton.cli, mdtriton.client.grpc_client, mdtriton.client.pipeline, mdtriton.client.sampler, "
            "mdtriton.client.shared_memory; mdtriton.cli.make_parser('health').parse_args(['health']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'transformers')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def held_port(port: int) -> socket.socket | None:
    """A socket bound to 127.0.0.1:port (None if something else holds it already): taken either way."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


@pytest.mark.timeout(300)
def test_build_serve_infer_and_stop_cleanly(tmp_path):
    """serve takes Triton's usual ports where they are free (the client commands' defaults reach it), says which it
    could not take, keeps Triton's log in a file and prints the addresses last."""
    assert main(["build", str(tmp_path / "repo"), "--name", "tiny", "--tp", "2", "--seed", "1"]) == 0
    metrics_port = held_port(TRITON_PORTS["metrics"])
    serve = subprocess.Popen([sys.executable, "-m", "mdtriton.cli", "serve", str(tmp_path / "repo")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, address = [], None
        deadline = time.monotonic() + 180
        while address is None and time.monotonic() < deadline:
            lines.append(serve.stdout.readline())
            match = re.search(r"ready: gRPC (\S+)  HTTP \S+  metrics http://127.0.0.1:(\d+)/metrics", lines[-1])
            address = match.group(1) if match else None
        assert address, f"serve never printed its gRPC address: {lines}"
        assert int(match.group(2)) != TRITON_PORTS["metrics"]
        taken = re.search(r"Triton's usual port\(s\) (.*) taken on 127.0.0.1: serving on free ones instead", "".join(lines))
        assert taken and "8002 (metrics)" in taken.group(1)
        log_file = Path(re.search(r"Triton's log: (\S+)", "".join(lines)).group(1))
        assert "Started GRPCInferenceService" in log_file.read_text()
        assert all("I1" not in line and "W1" not in line for line in lines)  # no Triton log line here
        if "8001 (grpc)" not in taken.group(1):  # free when serve started: the client commands' default reaches it
            assert address == "127.0.0.1:8001"
            result = mdtriton("health")
            assert result.returncode == 0 and "server 127.0.0.1:8001: live, ready" in result.stdout, result.stderr
        server_pid = int(subprocess.run(["pgrep", "-f", f"tritonserver.*{tmp_path}"], capture_output=True,
                                        text=True).stdout.split()[0])
        assert len(stub_processes(server_pid)) == 2  # one stub per rank
        np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((1, 4, 64), dtype=np.float32))
        result = mdtriton("infer", "tiny", "--url", address, "--input", f"hidden_states={tmp_path / 'x.npy'}",
                          "--output", str(tmp_path / "out"))
        assert result.returncode == 0, result.stderr
        assert np.load(tmp_path / "out" / "output.npy").shape == (1, 4, 64)
        assert "latency:" in result.stdout
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)
        if metrics_port is not None:
            metrics_port.close()
    assert serve.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)
    assert stub_processes(server_pid) == {}


def test_infer_against_no_server_fails_in_one_line(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((1, 4, 64), np.float32))
    result = mdtriton("infer", "tiny", "--url", "127.0.0.1:1", "--input", f"hidden_states={tmp_path / 'x.npy'}",
                      "--timeout", "5")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "error" in result.stderr.lower()


@pytest.mark.parametrize("arguments, message", [
    (["--request-timeout", "-5"], "request timeout -5 s: give a positive number of seconds"),
    (["--request-timeout", "0"], "request timeout 0 s: give a positive number of seconds"),
    (["--request-timeout", "nan"], "request timeout nan s: give a positive number of seconds"),
    (["--name", "../evil"], "model name '../evil': use 1 to 100 letters"),
    (["--name", "a b"], "model name 'a b': use 1 to 100 letters"),
    (["--name", "a/b"], "model name 'a/b': use 1 to 100 letters"),
    (["--tp", "2", "--elastic"], "--elastic runs each job on a group of ranks that each hold the whole transformer; "
                                 "tensor parallelism (--tp 2) splits it"),
])
def test_build_refuses_a_request_timeout_or_name_it_cannot_serve(tmp_path, capsys, arguments, message):
    """One `error:` line, exit code 1, nothing written (in the repository or beside it)."""
    repository = tmp_path / "repo"
    assert main(["build", str(repository), "--name", "m", *arguments]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"error: {message}") and error.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_generate_refuses_a_seed_out_of_range_and_an_output_it_cannot_overwrite(tmp_path, capsys):
    """Both found before any request (no server here): a seed beyond INT64 at parse time, an output that is a
    directory (or a file this user may not overwrite) before the image is made."""
    with pytest.raises(SystemExit) as exited:
        main(["generate", "flux", "a cat", "--url", "127.0.0.1:1", "--seed", "99999999999999999999"])
    assert exited.value.code == 2
    assert ("error: argument --seed: 99999999999999999999 is out of range; give -9223372036854775808 to "
            "9223372036854775807") in capsys.readouterr().err
    taken = tmp_path / "image.png"
    taken.mkdir()
    assert main(["generate", "flux", "a cat", "--url", "127.0.0.1:1", "-o", str(taken)]) == 1
    assert f"error: cannot write {taken}: it is a directory" in capsys.readouterr().err


def test_a_killed_servers_backend_directory_is_removed_by_the_next_start():
    """`mdtriton serve` killed by SIGKILL cannot remove its backend directory; the next start removes those whose
    owner has exited, and keeps those of live owners."""
    from mdtriton.server import BACKEND_DIR_PREFIX, remove_left_backend_dirs

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    left = Path(tempfile.mkdtemp(prefix=f"{BACKEND_DIR_PREFIX}{exited.pid}-"))
    (left / "python").mkdir()
    live = Path(tempfile.mkdtemp(prefix=f"{BACKEND_DIR_PREFIX}{os.getpid()}-"))
    try:
        assert left in remove_left_backend_dirs()
        assert not left.exists() and live.is_dir()
    finally:
        shutil.rmtree(left, ignore_errors=True)
        shutil.rmtree(live)
