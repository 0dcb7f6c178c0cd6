"""Loading and unloading through Triton's model control API (gRPC), many times, leaves nothing behind; two
versions of a model and another model served side by side never mix their ranks."""

from __future__ import annotations

import os
import time

import pytest
import tritonclient.grpc as grpcclient

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.grpc_client import Client
from mdtriton.client.server_key import key_headers
from mdtriton.build_tools.model_config import read_model_config, write_model_config
from mdtriton.engine.plan import ParallelPlan
from tests.backend.load_clients import CONFIG, Clients, Reference, ask
from mdtriton.testing.triton_processes import (files_under, rank_workers, rss_bytes, still_running, thread_count,
                                            wait_for_stubs)

CYCLES = int(os.environ.get("MDTRITON_RELOAD_CYCLES", "6"))
# Server memory growing by this much a cycle after the first fails the test (it grew by 1 MiB in 20 cycles).
LEAK_PER_CYCLE = 2 * 2**20


@pytest.mark.timeout(600)
def test_load_unload_cycles_answer_right_and_leak_nothing(tmp_path, rendezvous_root, server_factory):
    build_model_version(tmp_path / "repo", "tiny", BuildRequest(
        "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=7, progress=False))
    server = server_factory(tmp_path / "repo", model_control_mode="explicit")
    client = grpcclient.InferenceServerClient(server.grpc_address)
    reference = Reference(7)
    server_pid = server.process.pid
    seen_stubs, threads, memory, seconds = set(), [], [], []
    for cycle in range(CYCLES):
        start = time.monotonic()
        client.load_model("tiny", headers=key_headers(server.grpc_address))
        stubs = wait_for_stubs(server_pid, 2)
        assert len(stubs) == 2 and seen_stubs.isdisjoint(stubs.values()), f"cycle {cycle}: {stubs}"
        seen_stubs.update(stubs.values())
        outcomes = [ask(client, "tiny", reference, cycle + i) for i in range(3)]
        assert all(o.status is None and o.right for o in outcomes), f"cycle {cycle}: {outcomes}"
        workers = {pid for pids in rank_workers(server_pid).values() for pid in pids}
        assert len(workers) == 2, f"cycle {cycle}: workers {rank_workers(server_pid)}"
        Client(server.grpc_address).unload("tiny")  # returns once Triton has finished unloading
        assert wait_for_stubs(server_pid, 0) == {}, f"cycle {cycle}: stubs left after unload"
        assert still_running(workers, 10) == set(), f"cycle {cycle}: workers left after unload"
        assert not client.is_model_ready("tiny")
        assert files_under(rendezvous_root) == [], f"cycle {cycle}: rendezvous files left"
        seconds.append(time.monotonic() - start)
        threads.append(thread_count(server_pid))
        memory.append(rss_bytes([server_pid]))
    print(f"{CYCLES} load/unload cycles: {sum(seconds) / CYCLES:.1f} s each; server threads {threads}; "
          f"server RSS {memory[0] / 2**20:.0f} -> {memory[-1] / 2**20:.0f} MiB")
    # After a first cycle (Triton creates some threads and buffers on first use), nothing grows with cycles.
    assert max(threads[1:]) <= threads[1] + 2, threads
    first = min(1, CYCLES - 1)
    assert memory[-1] - memory[first] < LEAK_PER_CYCLE * max(CYCLES - 1 - first, 1), memory


def serve_all_versions(model_dir) -> None:
    config = read_model_config(model_dir / "config.pbtxt")
    config.version_policy.all.SetInParent()
    write_model_config(model_dir / "config.pbtxt", config)


@pytest.mark.timeout(300)
def test_two_versions_and_two_models_side_by_side_never_cross_ranks(tmp_path, rendezvous_root, server_factory):
    repository = tmp_path / "repo"
    for version, seed in ((1, 11), (2, 12)):
        build_model_version(repository, "tiny", BuildRequest(
            "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=seed, version=version,
            progress=False))
    serve_all_versions(repository / "tiny")
    build_model_version(repository, "other", BuildRequest(
        "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=13, progress=False))
    server = server_factory(repository)
    assert len(wait_for_stubs(server.process.pid, 6)) == 6  # 2 ranks x (tiny v1, tiny v2, other v1)
    targets = [("tiny", "1", Reference(11)), ("tiny", "2", Reference(12)), ("other", "1", Reference(13))]
    clients = [Clients(server.grpc_address, model, reference, count=3, version=version).start()
               for model, version, reference in targets]
    time.sleep(8)
    for (model, version, _), group in zip(targets, clients):
        outcomes = group.stop()
        assert len(outcomes) > 10 and all(o.status is None and o.right for o in outcomes), (model, version)
    areas = {name for name in files_under(rendezvous_root) if "/" not in name}
    assert len(areas) == 3 and {area.rsplit("-", 1)[1] for area in areas} == {"v1", "v2"}
    # Each load met in a single epoch of its own: no rank ever joined another load's.
    epochs = [name for name in files_under(rendezvous_root) if name.count("/") == 1 and "/epoch" in name]
    assert len(epochs) == 3, epochs
    client = grpcclient.InferenceServerClient(server.grpc_address)
    assert ask(client, "tiny", targets[0][2], 0, version="2").right is False  # the versions differ
