"""TritonPythonModel.is_ready() in real stubs: true while the ranks serve together, false while they re-form after a
failure and once a rank is gone for good. Triton 2.51 never calls it, so the served model.py is wrapped by one
whose thread writes every change of is_ready() to a file, with the time."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from mdtriton.build_tools.build import build_model_version
from mdtriton.engine.plan import ParallelPlan
from tests.backend.load_clients import CONFIG, Reference, ask, large_input, send
from tests.backend.test_rank_faults import xfail_if_triton_aborted
from tests.backend.triton_processes import memory_capped, wait_for_stubs

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


@pytest.mark.timeout(300)
def test_is_ready_is_false_while_the_ranks_reform_and_after_a_rank_is_gone(tmp_path, rendezvous_root, server_factory):
    version_dir = build_model_version(tmp_path / "repo", MODEL, "tiny_transformer", CONFIG, ParallelPlan(tp_size=2),
                                      "FP32", "cpu", seed=SEED, request_timeout_s=20, progress=False)
    (version_dir / "model.py").write_text(PROBED_MODEL)
    server = server_factory(tmp_path / "repo", model_control_mode="explicit", load_models=(MODEL,),
                            extra_args=("--exit-timeout-secs=5",))
    stubs = wait_for_stubs(server.process.pid, 2)
    model_dir = tmp_path / "repo" / MODEL
    instances = ("rank_0", "rank_1")
    assert all(wait_until(lambda: ready_now(model_dir, i) is True, 30) for i in instances), \
        [readiness(model_dir, i) for i in instances]
    client = grpcclient.InferenceServerClient(server.grpc_address)
    reference = Reference(SEED)
    assert ask(client, MODEL, reference, 0).right

    # Rank 1 runs out of memory in a job: both ranks end the generation and re-form by themselves.
    changes_before = {i: len(readiness(model_dir, i)) for i in instances}
    with memory_capped(stubs["tiny/1/rank_1"], 16 * 2**20):
        failed, _ = send(client, MODEL, large_input())
    assert failed.status == "StatusCode.UNAVAILABLE", failed
    assert wait_until(lambda: ask(client, MODEL, reference, 1).right, 30)
    for instance in instances:
        changes = [ready for _, ready in readiness(model_dir, instance)[changes_before[instance]:]]
        assert changes == [False, True], f"{instance}: {changes}"

    # Rank 1's process is killed: rank 0 is not ready from then on.
    killed_at = time.monotonic()
    os.kill(stubs["tiny/1/rank_1"], signal.SIGKILL)
    assert wait_until(lambda: ready_now(model_dir, "rank_0") is False, 10)
    time.sleep(2)
    xfail_if_triton_aborted(server)
    not_ready_since, ready = readiness(model_dir, "rank_0")[-1]
    assert ready is False and not_ready_since - killed_at < 3, readiness(model_dir, "rank_0")
