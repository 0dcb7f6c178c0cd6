"""TritonPythonModel.is_ready() in real stubs: true while the ranks serve together, false while they heal after a
failure. Triton 2.51 never calls it, so the served model.py is wrapped by one
whose thread writes every change of is_ready() to a file, with the time."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.engine.plan import ParallelPlan
from tests.backend.load_clients import CONFIG, Reference, ask, large_input, send
from tests.backend.test_rank_faults import one_worker_per_rank
from mdtriton.testing.triton_processes import memory_capped, stub_processes, wait_for_stubs

MODEL = "tiny"
SEED = 9

PROBED_MODEL = '''
import threading
import time
from pathlib import Path

from mdtriton.backend.model import TritonPythonModel as ServedModel


class TritonPythonModel(ServedModel):
    """The served model, and a thread writing each change of is_ready() to ready-<instance>.log ("<time> <ready>")."""

    def initialize(self, args):
        super().initialize(args)
        self.probe_stop = threading.Event()
        path = Path(args["model_repository"]) / f"ready-{args['model_instance_name']}.log"
        threading.Thread(target=self.probe, args=(path,), daemon=True).start()

    def probe(self, path):
        last = None
        while not self.probe_stop.wait(0.01):
            ready = self.is_ready()
            if ready != last:
                with open(path, "a") as log:
                    log.write(f"{time.monotonic()} {ready}\\n")
                last = ready

    def finalize(self):
        self.probe_stop.set()
        super().finalize()
'''


def readiness(model_dir: Path, instance: str) -> list[tuple[float, bool]]:
    """The changes of one instance's is_ready() so far: (time.monotonic(), ready)."""
    path = model_dir / f"ready-{instance}.log"
    lines = path.read_text().split("\n") if path.exists() else []
    return [(float(when), ready == "True") for when, ready in (line.split() for line in lines if line)]


def ready_now(model_dir: Path, instance: str) -> bool | None:
    """The instance's last is_ready() (None before its first)."""
    changes = readiness(model_dir, instance)
    return changes[-1][1] if changes else None


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def ready_changes_since(model_dir: Path, before: dict[str, int]) -> dict[str, list[bool]]:
    return {instance: [ready for _, ready in readiness(model_dir, instance)[count:]] for instance, count in before.items()}


@pytest.mark.timeout(300)
def test_is_ready_is_false_while_the_ranks_heal(tmp_path, rendezvous_root, server_factory):
    version_dir = build_model_version(tmp_path / "repo", MODEL, BuildRequest(
        "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=SEED, request_timeout_s=30,
        progress=False))
    (version_dir / "model.py").write_text(PROBED_MODEL)
    server = server_factory(tmp_path / "repo", model_control_mode="explicit", load_models=(MODEL,))
    stubs = wait_for_stubs(server.process.pid, 2)
    model_dir = tmp_path / "repo" / MODEL
    instances = ("rank_0", "rank_1")
    assert all(wait_until(lambda: ready_now(model_dir, i) is True, 30) for i in instances), \
        [readiness(model_dir, i) for i in instances]
    client = grpcclient.InferenceServerClient(server.grpc_address)
    reference = Reference(SEED)
    assert ask(client, MODEL, reference, 0).right

    # Rank 1's worker runs out of memory in a job: the epoch ends on both ranks, and both heal.
    before = {i: len(readiness(model_dir, i)) for i in instances}
    with memory_capped(one_worker_per_rank(server)[1], 16 * 2**20):
        answered, _ = send(client, MODEL, large_input())
    assert answered.status is None, answered
    assert ready_changes_since(model_dir, before) == {i: [False, True] for i in instances}

    # Rank 1's worker is killed: not ready until the new workers serve.
    before = {i: len(readiness(model_dir, i)) for i in instances}
    killed_at = time.monotonic()
    os.kill(one_worker_per_rank(server)[1], signal.SIGKILL)
    assert wait_until(lambda: ready_changes_since(model_dir, before) == {i: [False, True] for i in instances}, 30), \
        ready_changes_since(model_dir, before)
    not_ready_at = readiness(model_dir, "rank_0")[before["rank_0"]][0]
    assert not_ready_at - killed_at < 2, not_ready_at - killed_at
    assert ask(client, MODEL, reference, 1).right
    assert stub_processes(server.process.pid) == stubs
