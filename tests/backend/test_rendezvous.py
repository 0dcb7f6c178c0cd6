"""The rendezvous: ranks of one load meet in one generation, never in another load's, and leave no files."""

from __future__ import annotations

import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mdtriton.backend.rendezvous import Rendezvous, RendezvousTimeout


def join_all(directory, world_size, delays=None):
    delays = delays or [0] * world_size
    stop = threading.Event()

    def join(rank):
        time.sleep(delays[rank])
        return Rendezvous(directory, rank, world_size).join(10, stop)

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(join, range(world_size)))


def test_parallel_joins_meet_in_one_generation(tmp_path):
    generations = join_all(tmp_path, 4)
    assert {g.number for g in generations} == {1}
    assert len({g.token for g in generations}) == 1


def test_one_after_another_meet_in_one_generation(tmp_path):
    generations = join_all(tmp_path, 3, delays=[0, 0.3, 0.6])
    assert {g.number for g in generations} == {1}


def test_reload_gets_a_new_generation_and_leaving_cleans_up(tmp_path):
    first = join_all(tmp_path, 2)
    second = join_all(tmp_path, 2)  # the new load's ranks arrive while the first load still holds its slots
    assert {g.number for g in first} == {1} and {g.number for g in second} == {2}
    assert first[0].token != second[0].token
    for rank in range(2):
        Rendezvous(tmp_path, rank, 2).leave(1)
    assert not (tmp_path / "gen1").exists() and (tmp_path / "gen2").exists()
    for rank in range(2):
        Rendezvous(tmp_path, rank, 2).leave(2)
    assert not tmp_path.exists()


def test_missing_rank_times_out_with_its_number(tmp_path):
    with pytest.raises(RendezvousTimeout, match=r"ranks \[1\] did not join"):
        Rendezvous(tmp_path, 0, 2).join(0.5, threading.Event())
    assert not tmp_path.exists()


def _enter_and_die(directory):
    Rendezvous(directory, 0, 2)._enter()


def test_slot_of_a_process_that_died_while_waiting_is_reused(tmp_path):
    process = multiprocessing.get_context("spawn").Process(target=_enter_and_die, args=(tmp_path,))
    process.start()
    process.join()
    generations = join_all(tmp_path, 2)
    assert {g.number for g in generations} == {1}
    for rank in range(2):
        Rendezvous(tmp_path, rank, 2).leave(1)
    assert not tmp_path.exists()
