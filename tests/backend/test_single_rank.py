"""A model of one rank (world size 1) on a real tritonserver: its worker runs its jobs without a job hub, and keeps
every promise the ranks of a larger world keep: NaN and infinity refused without disturbing it, every job counted,
a killed worker healed, a job that fails answered after healing, a poison request failed after its second crash (a
stopped worker: tests/backend/test_rank_faults.py)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.backend.load_clients import Clients, Reference, ask, large_input, send
from mdtriton.testing.metrics import settled
from tests.backend.test_rank_faults import (HEALED_WITHIN_S, MODEL, SEED, healed_in, one_worker_per_rank,
                                            poison_input, serve, wait_for_an_answer)
from mdtriton.testing.triton_processes import memory_capped, stub_processes


def counters(server, names: tuple[str, ...]) -> dict[str, float]:
    """The one rank's values of mdtriton counters, once its stub has recorded every job answered so far."""
    return {name: sum(settled(server.metrics_url, name).values()) for name in names}


@pytest.mark.timeout(240)
def test_one_rank_runs_its_jobs_without_a_hub_refuses_nan_and_counts_every_job(tmp_path, rendezvous_root,
                                                                                server_factory):
    server, _, _ = serve(tmp_path, server_factory, request_timeout_s=30, world_size=1)
    reference = Reference(SEED)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    names = ("mdtriton_jobs_total", "mdtriton_wait_seconds_total", "mdtriton_compute_seconds_total")
    before = counters(server, names)
    outcomes = [ask(client, MODEL, reference, index) for index in range(6)]
    nan = reference.inputs[0].copy()
    nan.flat[5] = np.nan
    refused, _ = send(client, MODEL, nan)
    outcomes += [ask(client, MODEL, reference, index) for index in range(6, 9)]

    assert all(o.status is None and o.right for o in outcomes), outcomes
    assert refused.status == "StatusCode.INVALID_ARGUMENT", refused
    assert refused.message.endswith("input 'hidden_states' holds 1 NaN or infinite value(s); send finite numbers")
    after = counters(server, names)
    delta = {name: after[name] - before[name] for name in names}
    assert delta["mdtriton_jobs_total"] == 9, delta  # the good requests' jobs, none for the refused one
    assert delta["mdtriton_wait_seconds_total"] > 0 and delta["mdtriton_compute_seconds_total"] > 0, delta
    epochs = [path for path in rendezvous_root.rglob("epoch*") if path.is_dir()]
    assert epochs and not list(rendezvous_root.rglob("hub")), epochs  # serving, with no hub
    assert "healing" not in server.log_file.read_text(errors="replace")


@pytest.mark.timeout(300)
def test_one_rank_heals_after_a_kill_and_a_failed_job_and_fails_a_poison_request(tmp_path, rendezvous_root,
                                                                                  server_factory, crashing_family):
    server, stubs, workers = serve(tmp_path, server_factory, request_timeout_s=60, world_size=1,
                                   architecture=crashing_family)
    reference = Reference(SEED)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    clients = Clients(server.grpc_address, MODEL, reference, count=2).start()
    time.sleep(1)
    killed_at = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    healed = wait_for_an_answer(client, reference, killed_at)
    large = large_input()
    with memory_capped(one_worker_per_rank(server, 1)[0], 16 * 2**20):
        answered, output = send(client, MODEL, large)  # its job runs out of memory; the next worker runs it again
    poisoned, _ = send(client, MODEL, poison_input())
    outcomes = clients.stop()

    print(f"\none rank: answered again {healed:.1f} s after the kill; poison request: {poisoned.status} after "
          f"{poisoned.latency:.1f} s; the stub's healings: {healed_in(server)} s")
    assert healed <= HEALED_WITHIN_S
    assert answered.status is None and np.abs(output - reference.expected(large)).max() < 1e-4, answered
    assert poisoned.status == "StatusCode.INTERNAL", poisoned
    assert "running at two failures of the ranks in a row" in poisoned.message, poisoned.message
    assert "killed by SIGSEGV" in poisoned.message, poisoned.message
    assert outcomes and [o for o in outcomes if o.status is not None] == [] and all(o.right for o in outcomes)
    assert len(healed_in(server)) == 4  # the kill, the failed job, the poison request's two crashes
    assert workers[0] not in one_worker_per_rank(server, 1).values()
    assert server.process.poll() is None and stub_processes(server.process.pid) == stubs
