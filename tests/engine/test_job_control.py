"""How the ranks end a job together (mdtriton.engine.job_control) and what a collective's failure is
(mdtriton.engine.comm), on real gloo process groups of 2 and 3 ranks: a rank that fails before the job's collectives
ends it on every rank with its message (before or after a collective every rank makes ahead of the job's others), a
stop asked by one rank ends it on every rank after the same step, and only the backend's failures are
CommunicationErrors. After each, the ranks still sum a tensor together: none was left in a collective."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from mdtriton.engine.comm import CommunicationError, Communicator, is_backend_failure
from mdtriton.engine.job_control import JobAgreement, JobControl, JobFailed, JobStopped, controlled_by
from mdtriton.engine.plan import ParallelPlan
from tests.distributed import run_ranks


def world_sum(rank: int) -> float:
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return float(total)


def communicator(rank: int, world_size: int) -> Communicator:
    comm = Communicator(ParallelPlan(tp_size=world_size), rank, torch.device("cpu"))
    comm.join_groups()
    return comm


CASES = [  # (the ranks that fail before the collectives: (message, request error)), what every rank raises
    ({}, None),
    ({1: ("OSError: the disk went", False)}, ("rank 1: OSError: the disk went", False)),
    ({0: ("RuntimeError: out of memory", False), 2: ("no adapter 'x'", True)}, ("rank 2: no adapter 'x'", True)),
    ({2: ("b", False), 1: ("a", False)}, ("rank 1: a", False)),
]


def _agree(rank: int, world_size: int) -> list:
    """Each case on this rank, one job after another: the failing ranks fail before the job's collectives, the others
    reach its first collective; what this rank raised, and the ranks' sum after each."""
    comm = communicator(rank, world_size)
    results = []
    for failing, _ in CASES:
        agreement = JobAgreement(comm)
        try:
            if rank in failing:
                agreement.failed(*failing[rank])
            agreement.before_collectives()
            outcome = None
        except JobFailed as error:
            outcome = (str(error), error.request_error)
        results.append((outcome, world_sum(rank)))
    return results


def test_a_failure_before_the_collectives_ends_the_job_on_every_rank_with_its_message():
    """On 3 ranks: the request's own fault wins over another failure, then the lowest rank; after each job the ranks
    still sum together."""
    for results in run_ranks(3, _agree):
        assert results == [(expected, 6.0) for _, expected in CASES]


def _stop_after(rank: int, world_size: int, asked_at: int) -> dict:
    """Rank 0 (the request's) asks to stop once `asked_at` steps are done; every rank runs 10 steps."""
    done = []
    control = JobControl(on_progress=lambda step, total: done.append(step),
                         stop_requested=lambda: rank == 0 and len(done) >= asked_at)
    with controlled_by(control):
        agreement = JobAgreement(communicator(rank, world_size))
        try:
            for step in range(1, 11):
                agreement.step_done(step, 10)
            stopped = None
        except JobStopped as stop:
            stopped = (stop.done, stop.total, str(stop))
    return {"stopped": stopped, "steps": done, "sum": world_sum(rank)}


def _early_collective(rank: int, world_size: int) -> list:
    """Three jobs, each with a broadcast from rank 0 before its collective parts (a prompt encoded on rank 0): rank 0
    fails before the broadcast, rank 1 after it (before the job's first collective part), none fails."""
    comm = communicator(rank, world_size)
    results = []
    for fails_before, fails_after in ((0, None), (None, 1), (None, None)):
        agreement = JobAgreement(comm)
        try:
            if rank == fails_before:
                agreement.failed("TemplateError: a bad prompt", False)
            with agreement.early_collective():
                received = comm.broadcast(torch.tensor([rank + 7.0]), 0)
            if rank == fails_after:
                agreement.failed("a bad image", True)
            agreement.before_collectives()
            outcome = float(received)
        except JobFailed as error:
            outcome = (str(error), error.request_error)
        results.append((outcome, world_sum(rank)))
    return results


def test_a_failure_before_or_after_an_early_collective_ends_the_job_on_every_rank():
    """The ranks agree before the broadcast and again after it: either failure ends the job on both ranks with its
    message, and they still sum together."""
    expected = [(("rank 0: TemplateError: a bad prompt", False), 3.0), (("rank 1: a bad image", True), 3.0), (7.0, 3.0)]
    assert run_ranks(2, _early_collective) == [expected, expected]


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_stop_asked_by_the_request_rank_ends_the_job_on_every_rank_after_the_same_step(world_size):
    results = run_ranks(world_size, _stop_after, 4)
    for result in results:
        assert result["stopped"] == (4, 10, "stopped after 4 of 10 steps")
        assert result["steps"] == [1, 2, 3, 4]


def _collective_errors(rank: int, world_size: int) -> dict:
    comm = Communicator(ParallelPlan(cp_size=2, cp_method="ulysses"), rank, torch.device("cpu"))
    comm.join_groups()
    errors = {}
    for name, collective in {"uneven all-to-all": lambda: comm.ulysses_all_to_all(torch.ones(3, 4), torch.ones(3, 4)),
                             "broadcast from no rank": lambda: comm.broadcast(torch.ones(4), 7)}.items():
        try:
            collective()
            errors[name] = None
        except Exception as error:  # noqa: BLE001 - the test reports what each raised
            errors[name] = (type(error).__name__, isinstance(error, CommunicationError))
    return {"errors": errors, "sum": world_sum(rank)}


def test_a_tensor_a_collective_cannot_take_is_a_programming_error_raised_before_it():
    for result in run_ranks(2, _collective_errors):
        assert result["errors"]["uneven all-to-all"] == ("CollectiveInputError", False)
        # checked before any rank sends: no lost peer
        assert result["errors"]["broadcast from no rank"] == ("CollectiveInputError", False)
        assert result["sum"] == 3.0


def _peer_leaves(rank: int, world_size: int) -> str:
    """Rank 1 ends its process group; rank 0 then sums a tensor with it."""
    comm = communicator(rank, world_size)
    if rank == 1:
        dist.destroy_process_group()
        return "left"
    try:
        comm.tp_all_reduce(torch.ones(4))
        return "summed"
    except CommunicationError as error:
        return str(error)


def test_a_lost_peer_is_a_communication_error():
    left, lost = run_ranks(2, _peer_leaves)[::-1]
    assert left == "left" and lost.startswith("tensor-parallel all-reduce failed on rank 0: "), lost
    assert is_backend_failure(dist.DistBackendError("NCCL error: remote process exited or there was a network error"))


def _latents_go_bad(rank: int, world_size: int, bad_at: int) -> dict:
    """Every rank runs 10 steps; rank 1's latents hold a NaN from step `bad_at` on (the others' stay finite)."""
    comm = communicator(rank, world_size)
    agreement = JobAgreement(comm)
    try:
        for step in range(1, 11):
            latents = torch.ones(2, 8)
            if rank == 1 and step >= bad_at:
                latents[1, 3] = math.nan
            agreement.step_done(step, 10, latents)
        failed = None
    except JobFailed as error:
        failed = (str(error), error.request_error)
    return {"failed": failed, "sum": world_sum(rank)}


def test_latents_that_are_not_finite_fail_the_job_on_every_rank_naming_the_step():
    """Not a flat image answered OK: every rank fails the job after the step whose latents went bad (the request's
    fault is not assumed: answered INTERNAL), and the ranks still sum together after it."""
    for result in run_ranks(2, _latents_go_bad, 3):
        message, request_error = result["failed"]
        assert message.startswith("the latents held NaN or infinite values after denoising step 3 of 10")
        assert not request_error and result["sum"] == 3.0
