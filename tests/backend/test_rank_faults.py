"""Rank failures on a real tritonserver (2 CPU ranks, gloo) with clients streaming requests: a rank's worker killed
again and again, stopped (a hang), running out of memory in one job, crashing on one request (a poison request),
and dying too often. The ranks heal in place (same stubs, same server, new workers); no request gets a wrong
answer; requests wait for the healing instead of failing, except the poison request and those of a rank that
was given up, which fail at once and say why."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.grpc_client import Client
from mdtriton.client.server_key import key_headers
from mdtriton.build_tools.model_config import read_model_config, write_model_config
from mdtriton.engine.plan import ParallelPlan
from tests.backend.crashing_family import POISON
from tests.backend.load_clients import CONFIG, Clients, Reference, ask, large_input, send
from mdtriton.testing.triton_processes import memory_capped, rank_workers, stub_processes, wait_for_stubs, worker_rank

MODEL = "tiny"
SEED = 5
HEALED_WITHIN_S = 30.0


def serve(tmp_path, server_factory, request_timeout_s: float, world_size: int = 2,
          architecture: str = "tiny_transformer", **parameters):
    """Serve the tiny transformer (or architecture: "tiny_crashing", the crashing_family fixture's), tensor-parallel
    over world_size CPU ranks, with these config.pbtxt parameters; the server, its stubs and rank -> worker pid."""
    version_dir = build_model_version(tmp_path / "repo", MODEL, BuildRequest(
        architecture, CONFIG, ParallelPlan(tp_size=world_size), "FP32", "cpu", seed=SEED,
        request_timeout_s=request_timeout_s, progress=False))
    config = read_model_config(version_dir.parent / "config.pbtxt")
    for key, value in parameters.items():
        config.parameters[key].string_value = str(value)
    write_model_config(version_dir.parent / "config.pbtxt", config)
    server = server_factory(tmp_path / "repo", model_control_mode="explicit", load_models=(MODEL,))
    stubs = wait_for_stubs(server.process.pid, world_size)
    return server, stubs, one_worker_per_rank(server, world_size)


def one_worker_per_rank(server, world_size: int = 2, timeout: float = HEALED_WITHIN_S) -> dict[int, int]:
    """rank -> worker pid, once every stub holds exactly one worker (fails the test if that does not happen)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = rank_workers(server.process.pid)
        if sorted(map(len, workers.values())) == [1] * world_size or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(map(len, workers.values())) == [1] * world_size, workers
    return {worker_rank(pids[0]): pids[0] for pids in workers.values()}


def wait_for_an_answer(client, reference: Reference, since: float, timeout: float = HEALED_WITHIN_S) -> float:
    """Ask until a request is answered right; seconds from `since` until then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ask(client, MODEL, reference, 0).right:
            return time.monotonic() - since
        time.sleep(0.05)
    raise AssertionError(f"no right answer within {timeout:.0f} s")


def healed_in(server) -> list[float]:
    """The healing times the stubs logged ("rank R: healed in S s")."""
    return [float(s) for s in re.findall(r"healed in ([\d.]+) s", server.log_file.read_text(errors="replace"))]


def poison_input() -> np.ndarray:
    array = np.zeros((1, 4, CONFIG["hidden_size"]), np.float32)
    array.flat[0] = POISON
    return array


@pytest.mark.timeout(600)
def test_a_worker_killed_five_times_heals_each_time_and_every_request_gets_the_right_answer(
        tmp_path, rendezvous_root, server_factory):
    server, stubs, workers = serve(tmp_path, server_factory, request_timeout_s=60)
    reference = Reference(SEED)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    clients = Clients(server.grpc_address, MODEL, reference, count=3).start()
    heal_seconds, killed = [], set()
    for kill in range(5):
        time.sleep(1.5)
        victim = workers[kill % 2]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        killed.add(victim)
        heal_seconds.append(wait_for_an_answer(client, reference, killed_at))
        workers = one_worker_per_rank(server)
        assert killed.isdisjoint(workers.values()), (killed, workers)
    outcomes = clients.stop()

    print(f"\n{len(outcomes)} requests; healing seen by a client: {['%.1f' % s for s in heal_seconds]} s; "
          f"logged by the stubs: {healed_in(server)}; slowest request {max(o.latency for o in outcomes):.1f} s")
    assert [o for o in outcomes if o.status is not None] == [], "a request failed"
    assert all(o.right for o in outcomes), "a wrong answer"
    assert max(heal_seconds) <= HEALED_WITHIN_S
    assert len(healed_in(server)) >= 10  # both ranks, each time
    assert server.process.poll() is None and stub_processes(server.process.pid) == stubs
    assert set(one_worker_per_rank(server).values()).isdisjoint(killed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 1])
def test_a_stopped_worker_is_healed_after_the_timeout(tmp_path, rendezvous_root, server_factory, world_size):
    """A hang, simulated by SIGSTOP of rank 0's worker: in a world of two ranks it also runs the job hub, and the
    other rank's collective times out; a world of one rank has no collective, and its request times out."""
    timeout = 4
    server, stubs, workers = serve(tmp_path, server_factory, request_timeout_s=timeout, world_size=world_size)
    reference = Reference(SEED)
    clients = Clients(server.grpc_address, MODEL, reference, count=3).start()
    time.sleep(1.5)
    stopped_at = time.monotonic()
    os.kill(workers[0], signal.SIGSTOP)
    healed = wait_for_an_answer(grpcclient.InferenceServerClient(server.grpc_address), reference, stopped_at)
    time.sleep(1)
    outcomes = clients.stop()

    print(f"\n{world_size} rank(s), stopped worker: healed {healed:.1f} s after the stop (timeout {timeout} s); "
          f"outcomes {sorted({o.status for o in outcomes}, key=str)}")
    assert all(o.right for o in outcomes if o.status is None), "a wrong answer"
    assert timeout <= healed <= timeout + HEALED_WITHIN_S
    for outcome in outcomes:
        assert outcome.status in (None, "StatusCode.UNAVAILABLE"), outcome
        assert outcome.status is None or "within 4 s" in outcome.message, outcome.message
    assert [o for o in outcomes if o.start > stopped_at + healed and o.status is None]  # serving again
    assert workers[0] not in one_worker_per_rank(server, world_size).values()  # killed, not continued
    assert server.process.poll() is None and stub_processes(server.process.pid) == stubs


@pytest.mark.timeout(300)
def test_a_poison_request_fails_clearly_after_the_second_crash_and_the_others_succeed(tmp_path, rendezvous_root,
                                                                                     server_factory, crashing_family):
    server, stubs, workers = serve(tmp_path, server_factory, request_timeout_s=60, architecture=crashing_family)
    reference = Reference(SEED)
    clients = Clients(server.grpc_address, MODEL, reference, count=2).start()
    time.sleep(1.5)
    poisoned, _ = send(grpcclient.InferenceServerClient(server.grpc_address), MODEL, poison_input())
    time.sleep(1)
    outcomes = clients.stop()

    print(f"\npoison request: {poisoned.status} after {poisoned.latency:.1f} s: {poisoned.message}")
    assert poisoned.status == "StatusCode.INTERNAL", poisoned
    assert "running at two failures of the ranks in a row" in poisoned.message, poisoned.message
    assert "killed by SIGSEGV" in poisoned.message, poisoned.message
    assert [o for o in outcomes if o.status is not None] == [] and all(o.right for o in outcomes)
    assert len(healed_in(server)) == 4  # two healings, both ranks
    assert set(one_worker_per_rank(server).values()).isdisjoint(workers.values())
    assert server.process.poll() is None and stub_processes(server.process.pid) == stubs


@pytest.mark.timeout(240)
def test_a_request_that_fails_on_one_rank_alone_is_answered_after_healing(tmp_path, rendezvous_root, server_factory):
    """Rank 1's worker runs out of memory (RLIMIT_DATA) in a large request; rank 0 is left in a collective that can
    never complete. Both end the epoch; the new workers (without the limit) run the request again."""
    server, stubs, workers = serve(tmp_path, server_factory, request_timeout_s=60)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    assert ask(client, MODEL, Reference(SEED), 0).right
    large = large_input()
    with memory_capped(workers[1], 16 * 2**20):
        answered, output = send(client, MODEL, large)
    assert answered.status is None, answered
    assert np.abs(output - Reference(SEED).expected(large)).max() < 1e-4
    assert "rank 1: " in server.log_file.read_text(errors="replace")  # the failure, in the log
    assert set(one_worker_per_rank(server).values()).isdisjoint(workers.values())
    assert stub_processes(server.process.pid) == stubs


@pytest.mark.timeout(300)
def test_a_rank_whose_worker_keeps_dying_is_given_up_and_requests_fail_fast_naming_it(tmp_path, rendezvous_root,
                                                                                       server_factory):
    server, stubs, workers = serve(tmp_path, server_factory, request_timeout_s=30, heal_limit=2)
    reference = Reference(SEED)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    for death in range(3):
        killed_at = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)
        if death < 2:
            wait_for_an_answer(client, reference, killed_at)
            workers = one_worker_per_rank(server)
    # Rank 0 learns that rank 1 was given up through the rendezvous, once its own new worker has loaded and looks
    # for its peers (3.4 s after the kill on a loaded 2-core machine): wait for that, then every request fails fast.
    deadline = time.monotonic() + HEALED_WITHIN_S
    while "rank 0: rank 1's worker died 3 times" not in server.log_file.read_text(errors="replace"):
        assert time.monotonic() < deadline, "rank 0 never learned that rank 1 was given up"
        time.sleep(0.1)
    outcomes = [ask(client, MODEL, reference, i) for i in range(6)]  # Triton spreads them over both instances

    assert all(o.status == "StatusCode.UNAVAILABLE" and o.latency < 1.0 for o in outcomes), outcomes
    for outcome in outcomes:
        assert "rank 1's worker died 3 times within 600 s" in outcome.message, outcome.message
        assert "reload the model" in outcome.message, outcome.message
    assert rank_workers(server.process.pid) == {name: [] for name in stubs}  # no worker holds memory for nothing
    Client(server.grpc_address).unload(MODEL)  # returns once Triton has finished unloading
    client.load_model(MODEL, headers=key_headers(server.grpc_address))
    assert wait_for_an_answer(client, reference, time.monotonic()) < HEALED_WITHIN_S
