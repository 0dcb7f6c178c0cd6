"""Rank failures on a real tritonserver (2 CPU ranks, gloo) with requests in flight: a rank killed, a rank
stopped (a hang), a rank that fails a job alone (out of memory). Every request ends, right or with a clear
error, within a bounded time; nothing wrong is ever answered; the model recovers (by itself when every rank
process is alive, by a reload when one has exited)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import tritonclient.grpc as grpcclient

from mdtriton.build_tools.build import build_model_version
from mdtriton.engine.plan import ParallelPlan
from tests.backend.load_clients import CONFIG, Clients, Reference, ask, large_input, send
from tests.backend.triton_processes import files_under, memory_capped, stub_processes, wait_for_stubs

MODEL = "tiny"
SEED = 5


def serve(tmp_path, server_factory, request_timeout_s: float):
    build_model_version(tmp_path / "repo", MODEL, "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu",
                        seed=SEED, request_timeout_s=request_timeout_s, progress=False)
    # Triton never finishes unloading a model one of whose stubs died after a request reached it (see
    # reload_recovers), so the server's shutdown always waits out its exit timeout: keep that short.
    server = server_factory(tmp_path / "repo", model_control_mode="explicit", load_models=(MODEL,),
                            extra_args=("--exit-timeout-secs=5",))
    return server, wait_for_stubs(server.process.pid, 2)


def triton_dead_stub(rank: int) -> str:
    """Triton's own answer for a request it routed to the instance of a dead (or stopped) stub."""
    return f"Stub process 'rank_{rank}' is not healthy"


def reload_recovers(server, reference: Reference, broken_stubs: dict[str, int], rendezvous) -> None:
    """Unload + load (a plain load of unchanged files is a no-op in Triton): new ranks answer right, and the
    broken load's surviving ranks stay, idle, once the new ranks have met (Triton never finalizes them)."""
    client = grpcclient.InferenceServerClient(server.grpc_address)
    client.unload_model(MODEL)
    client.load_model(MODEL)
    # The broken load's surviving stubs stay (idle, their weights given back): Triton 2.51 never finalizes them.
    survivors = len(set(stub_processes(server.process.pid).values()) & set(broken_stubs.values()))
    stubs = wait_for_stubs(server.process.pid, 2 + survivors)
    assert len(set(stubs.values()) - set(broken_stubs.values())) == 2
    outcomes = [ask(client, MODEL, reference, index) for index in range(4)]
    assert all(o.status is None and o.right for o in outcomes), outcomes
    area = files_under(rendezvous)
    assert len([name for name in area if name.count("/") == 1 and "/gen" in name]) == 1, area  # one live generation


def xfail_if_triton_aborted(server) -> None:
    """Triton 2.51 itself sometimes aborts when a stub dies or stops while holding the Python backend's IPC
    mutex ("boost::interprocess::lock_exception"; upstream triton-inference-server/server#8882, open). Nothing a
    model does can prevent that; the test marks such a run as the known upstream failure, and fails otherwise."""
    log = server.log_file.read_text(errors="replace") if server.log_file else ""
    if server.process.poll() is not None and "boost::interprocess::lock_exception" in log:
        pytest.xfail("tritonserver 2.51 aborted with boost::interprocess::lock_exception (upstream server#8882)")


def slower_than(outcomes, failed_at: float, limit: float) -> list:
    """The requests ending after the failure that took `limit` seconds or more counted from it (or their start)."""
    return [o for o in outcomes if o.end >= failed_at and o.end - max(o.start, failed_at) >= limit]


def summary(outcomes, failed_at: float, what: str) -> str:
    """The figures docs/reliability.md reports: how requests ended around a failure."""
    around = [o for o in outcomes if o.end >= failed_at]
    in_flight = [o for o in around if o.start < failed_at]
    later = [o for o in around if o.start >= failed_at]
    kinds = {}
    for o in around:
        kinds[o.status or "answer"] = kinds.get(o.status or "answer", 0) + 1

    def slowest(group):
        return max((o.end - max(o.start, failed_at) for o in group), default=0.0)

    return (f"\n{what}: {len(in_flight)} requests in flight ended at most {slowest(in_flight):.2f} s after the {what}; "
            f"{len(later)} later ones took at most {slowest(later):.2f} s; outcomes {kinds}")


def check_errors(outcomes, failed_rank: int) -> None:
    """Every error is ours (UNAVAILABLE, naming the failed rank) or Triton's for the failed rank's own instance."""
    for outcome in outcomes:
        if outcome.status == "StatusCode.UNAVAILABLE":
            assert f"rank {failed_rank}" in outcome.message, outcome.message
        else:
            assert outcome.status in (None, "StatusCode.INTERNAL"), outcome
            assert outcome.status is None or triton_dead_stub(failed_rank) in outcome.message, outcome.message


@pytest.mark.timeout(300)
def test_killed_rank_fails_every_request_fast_and_clearly_until_a_reload(tmp_path, rendezvous_root, server_factory):
    server, stubs = serve(tmp_path, server_factory, request_timeout_s=10)
    reference = Reference(SEED)
    clients = Clients(server.grpc_address, MODEL, reference, count=6).start()
    time.sleep(2)
    killed_at = time.monotonic()
    victim = stubs["tiny/1/rank_1"]
    os.kill(victim, signal.SIGKILL)
    time.sleep(4)
    outcomes = clients.stop()
    xfail_if_triton_aborted(server)

    assert [o for o in outcomes if o.end < killed_at and o.status is None], "no answer before the kill"
    assert all(o.right for o in outcomes if o.status is None), "a wrong answer"
    around = [o for o in outcomes if o.end >= killed_at]
    later = [o for o in outcomes if o.start > killed_at + 1]
    slow = slower_than(outcomes, killed_at, 3)
    assert not slow, f"requests not answered within 3 s of the kill: {slow}"
    assert later and all(o.status is not None for o in later)
    assert max(o.latency for o in later) < 1.5, "requests after the failure do not fail fast"
    check_errors(around, failed_rank=1)
    print(summary(outcomes, killed_at, "kill"))
    ours = [o.message for o in later if o.status == "StatusCode.UNAVAILABLE"]
    assert ours and all(f"rank 1 (pid {victim}) has exited" in m and "reloaded" in m for m in ours), ours[:1]
    # Triton 2.51 goes on reporting the model ready: a Python backend model cannot say otherwise (docs/reliability.md).
    client = grpcclient.InferenceServerClient(server.grpc_address)
    assert client.is_server_live() and client.is_model_ready(MODEL)
    reload_recovers(server, reference, stubs, rendezvous_root)


@pytest.mark.timeout(300)
def test_stopped_rank_fails_requests_within_the_timeout_until_killed_and_reloaded(tmp_path, rendezvous_root,
                                                                                 server_factory):
    """A hang, simulated by SIGSTOP. The stuck rank is then killed, not continued: continuing a stub that Triton
    2.51 has declared unhealthy can abort the whole server (docs/reliability.md)."""
    timeout = 4
    server, stubs = serve(tmp_path, server_factory, request_timeout_s=timeout)
    reference = Reference(SEED)
    clients = Clients(server.grpc_address, MODEL, reference, count=6).start()
    time.sleep(2)
    stopped_at = time.monotonic()
    victim = stubs["tiny/1/rank_0"]  # rank 0 also runs the job hub
    os.kill(victim, signal.SIGSTOP)
    time.sleep(timeout + 4)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert wait_for_stubs(server.process.pid, 1) == {"tiny/1/rank_1": stubs["tiny/1/rank_1"]}
    time.sleep(3)
    outcomes = clients.stop()
    xfail_if_triton_aborted(server)

    assert all(o.right for o in outcomes if o.status is None), "a wrong answer"
    around = [o for o in outcomes if o.end >= stopped_at]
    slow = slower_than(outcomes, stopped_at, timeout + 2)
    assert not slow, f"requests not answered within the request timeout: {slow}"
    check_errors(around, failed_rank=0)
    print(summary(outcomes, stopped_at, "stop"))
    # Answered before the kill (a request sent just before it may be answered after it, saying the rank exited).
    during = [o for o in outcomes if stopped_at + timeout + 1 < o.start and o.end < killed_at]
    assert during and all(o.status is not None for o in during)
    ours = [o.message for o in during if o.status == "StatusCode.UNAVAILABLE"]
    assert ours and all(f"rank 0 (pid {victim}) is stopped" in m for m in ours), \
        [m for m in ours if f"rank 0 (pid {victim}) is stopped" not in m][:2]
    after = [o.message for o in outcomes if o.start > killed_at + 1 and o.status == "StatusCode.UNAVAILABLE"]
    assert after and all(f"rank 0 (pid {victim}) has exited" in m for m in after), after[:1]
    assert server.process.poll() is None, "the server died"
    reload_recovers(server, reference, stubs, rendezvous_root)


@pytest.mark.timeout(240)
def test_rank_failing_a_job_alone_makes_the_ranks_reform_by_themselves(tmp_path, rendezvous_root, server_factory):
    """Rank 1 runs out of memory (RLIMIT_DATA) in a large request; rank 0 is left in a collective that can never
    complete. Both end the generation and, all processes being alive, form the next one without any reload."""
    server, stubs = serve(tmp_path, server_factory, request_timeout_s=20)
    reference = Reference(SEED)
    large = large_input()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    assert ask(client, MODEL, reference, 0).right
    with memory_capped(stubs["tiny/1/rank_1"], 16 * 2**20):
        failed, _ = send(client, MODEL, large)
    assert failed.status == "StatusCode.UNAVAILABLE" and "lost each other" in failed.message, failed
    deadline = time.monotonic() + 30
    outcome = ask(client, MODEL, reference, 1)
    while outcome.status is not None and time.monotonic() < deadline:
        assert outcome.status == "StatusCode.UNAVAILABLE" and "re-forming" in outcome.message, outcome
        time.sleep(0.2)
        outcome = ask(client, MODEL, reference, 1)
    assert outcome.status is None and outcome.right
    assert all(o.status is None and o.right for o in (ask(client, MODEL, reference, i) for i in range(6)))
    assert stub_processes(server.process.pid) == stubs  # the same processes: no restart, no reload
    assert "/gen2" in " ".join(files_under(rendezvous_root))  # they met again in the next generation
