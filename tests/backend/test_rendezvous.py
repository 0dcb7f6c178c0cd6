"""The rendezvous: ranks of one load meet in one epoch, never in another load's, hear at once that a rank
cannot take part, and leave no files."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mdtriton.backend import rendezvous
from mdtriton.backend.rendezvous import RankFailedToLoad, Rendezvous, RendezvousTimeout
from mdtriton.backend.rendezvous_state import STATE_FILE, AreaState, EpochRecord, LoadFailure


def join_all(directory, world_size, delays=None):
    delays = delays or [0] * world_size
    stop = threading.Event()

    def join(rank):
        time.sleep(delays[rank])
        return Rendezvous(directory, rank, world_size).join(10, stop)

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(join, range(world_size)))


def test_parallel_joins_meet_in_one_epoch(tmp_path):
    epochs = join_all(tmp_path, 4)
    assert {g.number for g in epochs} == {1}
    assert len({g.token for g in epochs}) == 1


def test_one_after_another_meet_in_one_epoch(tmp_path):
    epochs = join_all(tmp_path, 3, delays=[0, 0.3, 0.6])
    assert {g.number for g in epochs} == {1}


def test_reload_gets_a_new_epoch_and_leaving_cleans_up(tmp_path):
    first = join_all(tmp_path, 2)
    second = join_all(tmp_path, 2)  # the new load's ranks arrive while the first load still holds its slots
    assert {g.number for g in first} == {1} and {g.number for g in second} == {2}
    assert first[0].token != second[0].token
    for rank in range(2):
        Rendezvous(tmp_path, rank, 2).leave(1)
    assert not (tmp_path / "epoch1").exists() and (tmp_path / "epoch2").exists()
    for rank in range(2):
        Rendezvous(tmp_path, rank, 2).leave(2)
    assert not tmp_path.exists()


def test_missing_rank_times_out_with_its_number(tmp_path):
    with pytest.raises(RendezvousTimeout, match=r"ranks \[1\] did not join within 0 s"):
        Rendezvous(tmp_path, 0, 2).join(0.5, threading.Event())
    assert not tmp_path.exists()
    Rendezvous(tmp_path, 1, 3).enter()  # entered, still loading
    with pytest.raises(RendezvousTimeout, match=r"ranks \[2\] did not join and ranks \[1\] did not finish loading"):
        Rendezvous(tmp_path, 0, 3).join(0.5, threading.Event())


def test_a_rank_that_has_loaded_waits_for_every_rank_to_load_and_sees_a_late_failure(tmp_path):
    """All ranks enter as they start loading; a fast one must not form the group before a slow one has loaded,
    and gives up at once if the slow one then fails."""
    slow, fast = Rendezvous(tmp_path, 0, 2), Rendezvous(tmp_path, 1, 2)
    slow_number, fast_number = slow.enter(), fast.enter()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(fast.join, 10, threading.Event(), fast_number)
        time.sleep(0.5)
        assert not joined.done(), "joined before rank 0 had loaded"
        slow.fail(slow_number, "rank 0 could not load: EngineError: shard0.safetensors: not a readable safetensors file")
        with pytest.raises(RankFailedToLoad, match="rank 0 could not load: EngineError: shard0.safetensors"):
            joined.result(5)
    assert not tmp_path.exists()


def _enter_and_die(directory):
    Rendezvous(directory, 0, 2).enter()


def test_slot_of_a_process_that_died_while_waiting_is_reused(tmp_path):
    process = multiprocessing.get_context("spawn").Process(target=_enter_and_die, args=(tmp_path,))
    process.start()
    process.join()
    epochs = join_all(tmp_path, 2)
    assert {g.number for g in epochs} == {1}
    for rank in range(2):
        Rendezvous(tmp_path, rank, 2).leave(1)
    assert not tmp_path.exists()


def dead_pid() -> int:
    process = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True)
    return int(process.stdout)


def test_areas_of_dead_servers_are_removed(tmp_path):
    stale = tmp_path / f"{dead_pid()}-m-0123abcd-v1"
    (stale / "epoch1").mkdir(parents=True)
    live = tmp_path / f"{os.getpid()}-m-0123abcd-v1"
    live.mkdir()
    join_all(tmp_path / f"{os.getpid()}-other-0123abcd-v2", 1)
    assert not stale.exists() and live.exists()


def test_a_rank_that_cannot_load_stops_the_others_waiting(tmp_path):
    stop = threading.Event()
    waiting = Rendezvous(tmp_path, 0, 2)
    number = waiting.enter()
    failing = Rendezvous(tmp_path, 1, 2)
    failing.fail(failing.enter(), "rank 1 could not load: EngineError: shard1.safetensors is missing")
    started = time.monotonic()
    with pytest.raises(RankFailedToLoad, match="rank 1 could not load: EngineError: shard1.safetensors is missing"):
        waiting.join(10, stop, number)
    assert time.monotonic() - started < 1
    assert not tmp_path.exists()


def test_a_failure_waits_for_every_rank_still_starting_then_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(rendezvous, "FAILURE_NOTICE_S", 10.0)
    with ThreadPoolExecutor(1) as pool:
        failed = pool.submit(Rendezvous(tmp_path, 1, 3).fail, Rendezvous(tmp_path, 1, 3).enter(), "bad weights")
        for rank in (0, 2):  # ranks of the same load that started later, one after the other has seen it and left
            time.sleep(0.5)
            with pytest.raises(RankFailedToLoad, match="bad weights"):
                Rendezvous(tmp_path, rank, 3).join(10, threading.Event())
        started = time.monotonic()
        failed.result(10)
        assert time.monotonic() - started < 3, "the failed rank waited on after every rank had seen its failure"
    assert not tmp_path.exists()
    monkeypatch.setattr(rendezvous, "FAILURE_NOTICE_S", 1.0)
    alone = time.monotonic()
    Rendezvous(tmp_path, 0, 2).fail(Rendezvous(tmp_path, 0, 2).enter(), "bad weights")
    assert 1 < time.monotonic() - alone < 3 and not tmp_path.exists()


def test_area_state_keeps_its_typed_records_through_its_file(tmp_path):
    state = AreaState(current=3, last=4, epochs={
        3: EpochRecord(token="a1", members={0: 11, 1: 12}, entered={0, 1}, loaded={1: 12},
                       failed=LoadFailure(11, "rank 0 could not load: bad weights")),
        4: EpochRecord(token="b2", members={1: 12}, closed=True)})
    state.write(tmp_path / STATE_FILE)
    assert AreaState.read(tmp_path / STATE_FILE) == state
    assert AreaState.read(tmp_path / "absent.json") == AreaState()
