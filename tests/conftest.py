"""Shared fixtures: small engines built into a temporary model repository, and a real Triton server on it."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from mdtriton.backend.rendezvous import ROOT_ENV
from mdtriton.server import TritonServer


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Every server start_server started in this test session, with its log file.
STARTED: list[tuple[TritonServer, Path]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the end of the logs of the servers its server_factory started, and of every server that
    has died (exited with a code other than 0; each shown once): CI keeps nothing else of them."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    own = set(item.funcargs["tmp_path"].glob("server*.log")) if "server_factory" in item.fixturenames else set()
    for server, log_file in list(STARTED):
        code = server.process.poll() if server.process is not None else None
        if code not in (None, 0):
            STARTED.remove((server, log_file))
            report.sections.append((f"{log_file} (tritonserver exited with code {code})", log_tail(log_file)))
        elif log_file in own:
            report.sections.append((f"end of {log_file.name}", log_tail(log_file)))


def log_tail(log_file: Path) -> str:
    return log_file.read_text(errors="replace")[-6000:] if log_file.exists() else "(no log)"


def start_server(repository: Path, log_file: Path, ready_within: float = 180, **kwargs) -> TritonServer:
    """Start a server on free ports, ready within ready_within seconds; on failure, show the end of its log in the
    error."""
    try:
        server = TritonServer(repository, log_file=log_file, **kwargs).start(timeout=ready_within)
    except Exception as error:
        raise RuntimeError(f"{error}\n--- server log tail ---\n{log_tail(log_file)[-4000:]}") from error
    STARTED.append((server, log_file))
    return server


@pytest.fixture(scope="session", autouse=True)
def session_rendezvous_root():
    """Every server of the test session keeps its rendezvous areas in a directory of its own (short: the Unix
    socket paths in it must stay under 108 bytes), never in the machine's /tmp/mdtriton-rendezvous."""
    root = Path(tempfile.mkdtemp(prefix="mdt-rdv-"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ROOT_ENV, str(root))
        yield root
    left = sorted(str(path.relative_to(root)) for path in root.rglob("*"))
    shutil.rmtree(root, ignore_errors=True)
    assert not left, f"servers stopped normally left rendezvous files behind: {left}"


@pytest.fixture(scope="session", autouse=True)
def key_directory_of_the_run():
    """The servers of this test run write their keys (client/server_key.py) under a directory of their own, not
    in the user's $XDG_RUNTIME_DIR or ~/.cache; each server removes its key when it stops."""
    runtime = Path(tempfile.mkdtemp(prefix="mdt-run-"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_RUNTIME_DIR", str(runtime))
        yield runtime
    left = sorted(path.name for path in runtime.rglob("*.key"))
    shutil.rmtree(runtime, ignore_errors=True)
    assert not left, f"servers stopped normally left their keys behind: {left}"


@pytest.fixture
def rendezvous_root(monkeypatch):
    """A fresh rendezvous root for one test, to look at what its servers leave there."""
    root = Path(tempfile.mkdtemp(prefix="mdt-rdv-"))
    monkeypatch.setenv(ROOT_ENV, str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def server_factory(tmp_path):
    """Start servers for one test; each is stopped at the end of the test, and no later test's report shows its log
    (its own test's does, if it fails): a test may kill its server on purpose."""
    servers = []

    def start(repository: Path, **kwargs) -> TritonServer:
        server = start_server(repository, tmp_path / f"server{len(servers)}.log", **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
    STARTED[:] = [(server, log_file) for server, log_file in STARTED if server not in servers]


@pytest.fixture(scope="session")
def served_models(tmp_path_factory):
    """One server for the client, CLI, metrics and perf_analyzer tests: "tiny" v1 + v2 and "flux" (tests/served_models.py)."""
    from tests.served_models import build_served_models

    repository = tmp_path_factory.mktemp("served_models")
    build_served_models(repository)
    server = start_server(repository, repository.parent / "served_models.log")
    yield server
    server.stop()
