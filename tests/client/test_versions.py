"""Model versions side by side, then v1 unloaded while v2 keeps serving (explicit model control)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from mdtriton.cli import main
from mdtriton.client.grpc_client import Client, ClientError
from mdtriton.testing.metrics import scrape, settled
from tests.conftest import start_server
from tests.served_models import build_tiny_versions, tiny_reference


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("versions")
    build_tiny_versions(repository, "versioned")
    server = start_server(repository, repository.parent / "versions.log", model_control_mode="explicit",
                          load_models=("versioned",))
    yield server
    server.stop()


def answer(client: Client, version: str, x: np.ndarray) -> np.ndarray:
    return client.infer("versioned", {"hidden_states": x}, version=version)["output"]


def test_warm_up_ran_on_every_rank_during_the_load(explicit_server):
    """Each instance's warm-up request ran as a job on both ranks before the model turned READY."""
    received = scrape(explicit_server.metrics_url, "mdtriton_requests_received_total")
    jobs = settled(explicit_server.metrics_url, "mdtriton_jobs_total")
    for version in ("1", "2"):
        for rank in ("0", "1"):
            labels = (("model", "versioned"), ("rank", rank), ("version", version))
            assert received[labels] == 1  # its own warm-up request
            assert jobs[labels] == 2  # its own and the other instance's


@pytest.mark.timeout(240)
def test_v1_and_v2_side_by_side_then_v1_unloaded_while_v2_serves(explicit_server, capsys):
    url = explicit_server.grpc_address
    x = np.random.default_rng(0).standard_normal((1, 6, 64), dtype=np.float32)
    expected = {v: tiny_reference(v, torch.from_numpy(x)).numpy() for v in ("1", "2")}
    with Client(url) as client:
        for version in ("1", "2"):
            assert np.abs(answer(client, version, x) - expected[version]).max() < 1e-5

    # Requests to v2 keep going, without retries, while v1 is dropped (Triton reloads v2 meanwhile).
    answers, failures, stop = [], [], threading.Event()

    def keep_asking_v2():
        with Client(url, retries=0) as client:
            while not stop.is_set():
                try:
                    answers.append(answer(client, "2", x))
                except ClientError as error:
                    failures.append(str(error))

    asker = threading.Thread(target=keep_asking_v2)
    asker.start()
    try:
        assert main(["load", "versioned", "--versions", "2", "--url", url]) == 0
        during = len(answers)
    finally:
        stop.set()
        asker.join(timeout=60)
    assert "loaded versioned; versions ready: 2" in capsys.readouterr().out
    assert failures == [] and during > 0
    assert all(np.abs(a - expected["2"]).max() < 1e-5 for a in answers)

    assert main(["models", "--url", url]) == 0
    rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [["versioned", "1", "UNAVAILABLE"], ["versioned", "2", "READY"]]
    with Client(url, retries=0) as client:
        assert np.abs(answer(client, "2", x) - expected["2"]).max() < 1e-5
        with pytest.raises(ClientError, match="version 1"):
            answer(client, "1", x)

    assert main(["unload", "versioned", "--url", url]) == 0
    assert main(["infer", "versioned", "--url", url, "--retries", "0"]) == 1
    assert "has no available versions" in capsys.readouterr().err
