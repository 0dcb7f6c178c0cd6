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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that started servers shows the end of their logs (CI keeps nothing else of them)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and "server_factory" in item.fixturenames:
        for log_file in sorted(item.funcargs["tmp_path"].glob("server*.log")):
            report.sections.append((f"end of {log_file.name}", log_file.read_text()[-6000:]))


def start_server(repository: Path, log_file: Path, **kwargs) -> TritonServer:
    """Start a server on free ports; on failure, show the end of its log in the error."""
    try:
        return TritonServer(repository, log_file=log_file, **kwargs).start(timeout=180)
    except Exception as error:
        tail = log_file.read_text()[-4000:] if log_file.exists() else "(no log)"
        raise RuntimeError(f"{error}\n--- server log tail ---\n{tail}") from error


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


@pytest.fixture
def rendezvous_root(monkeypatch):
    """A fresh rendezvous root for one test, to look at what its servers leave there."""
    root = Path(tempfile.mkdtemp(prefix="mdt-rdv-"))
    monkeypatch.setenv(ROOT_ENV, str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def server_factory(tmp_path):
    """Start servers for one test; each is stopped at the end of the test."""
    servers = []

    def start(repository: Path, **kwargs) -> TritonServer:
        server = start_server(repository, tmp_path / f"server{len(servers)}.log", **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def served_models(tmp_path_factory):
    """One server for the client, CLI, metrics and perf_analyzer tests: "tiny" v1 + v2 and "flux" (tests/served_models.py)."""
    from tests.served_models import build_served_models

    repository = tmp_path_factory.mktemp("served_models")
    build_served_models(repository)
    server = start_server(repository, repository.parent / "served_models.log")
    yield server
    server.stop()
