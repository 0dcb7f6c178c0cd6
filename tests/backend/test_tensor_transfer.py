"""Tensors between a stub and its worker: every data type and shape arrives equal, through memory that has no
name in /dev/shm (nothing a crash could leave behind); a region is reused once the receiver has dropped a message's
tensors, never before, and everything is unmapped once both ends are closed and the tensors dropped."""

from __future__ import annotations

import gc
import mmap
import os
import socket
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from mdtriton.backend.tensor_transfer import TensorLink


def link_pair() -> tuple[TensorLink, TensorLink]:
    left, right = socket.socketpair()
    return TensorLink(Connection(left.detach())), TensorLink(Connection(right.detach()))


def open_memfds() -> list[str]:
    """The descriptors of this process open on our shared memory (other tests' descriptors come and go meanwhile)."""
    found = []
    for descriptor in os.listdir("/proc/self/fd"):
        try:
            if "memfd:mdtriton-tensors" in os.readlink(f"/proc/self/fd/{descriptor}"):
                found.append(descriptor)
        except OSError:
            pass
    return found


def mappings() -> int:
    """How many mappings of our shared memory this process has (sender's and receiver's of each region)."""
    return Path("/proc/self/maps").read_text().count("memfd:mdtriton-tensors")


def test_tensors_arrive_equal_in_place_and_leave_nothing_in_dev_shm():
    sender, receiver = link_pair()
    shm_before = set(os.listdir("/dev/shm"))
    mapped_before = mappings()
    tensors = {"hidden_states": torch.randn(2, 9, 64), "timestep": torch.rand(3, dtype=torch.bfloat16),
               "ids": torch.arange(7, dtype=torch.int64).reshape(7, 1), "odd": torch.randn(5, 3)[:, 1],
               "empty": torch.empty(0, 4)}
    sender.send({"type": "job", "id": "a"}, tensors)
    sender.send({"type": "stop"})
    message = receiver.receive()
    assert message["type"] == "job" and message["id"] == "a"
    for name, tensor in tensors.items():
        arrived = message["tensors"][name]
        assert arrived.dtype == tensor.dtype and arrived.shape == tensor.shape
        assert torch.equal(arrived, tensor), name
        assert arrived.data_ptr() % 64 == 0, name
    assert receiver.receive() == {"type": "stop"}
    assert set(os.listdir("/dev/shm")) == shm_before
    assert mappings() == mapped_before + 2  # one region, mapped by both ends
    sender.close()
    receiver.close()
    del message, arrived, sender, receiver
    gc.collect()
    assert mappings() == mapped_before  # unmapped with the links and the tensors
    assert open_memfds() == []  # and no descriptor left open


def test_a_region_is_reused_once_its_tensors_are_dropped_and_never_before():
    sender, receiver = link_pair()
    first, second = torch.randn(1, 512, 64), torch.randn(1, 512, 64)
    sender.send({"id": 1}, {"x": first})
    held = receiver.receive()["tensors"]["x"]
    sender.send({"id": 2}, {"x": second})  # the first message's tensor is held: a second region
    arrived = receiver.receive()["tensors"]["x"]
    assert torch.equal(held, first) and torch.equal(arrived, second)
    assert arrived.data_ptr() != held.data_ptr()
    held_address = held.data_ptr()
    del held
    receiver.send({"type": "ack"})  # names the first region, now dropped
    assert sender.receive() == {"type": "ack"}
    mapped, descriptors = mappings(), len(open_memfds())
    third = torch.randn(1, 500, 64)  # a little smaller: fits the free region
    sender.send({"id": 3}, {"x": third})
    again = receiver.receive()["tensors"]["x"]
    assert again.data_ptr() == held_address and torch.equal(again, third)
    assert torch.equal(arrived, second)  # the region still held was not touched
    assert mappings() == mapped and len(open_memfds()) == descriptors  # no new memory, no new descriptor
    sender.close()
    receiver.close()


@contextmanager
def lending_links_and_file(name: str):
    """(the stub's end, which lends tensors in /dev/shm files; the worker's end; a fresh /dev/shm file's path)."""
    left, right = socket.socketpair()
    sender = TensorLink(Connection(left.detach()), lends_shared_files=True)
    receiver = TensorLink(Connection(right.detach()))
    path = Path(f"/dev/shm/mdtriton-test-{name}-{os.getpid()}")
    try:
        yield sender, receiver, path
    finally:
        path.unlink(missing_ok=True)
        sender.close()
        receiver.close()


def mapped(path: Path, size: int) -> mmap.mmap:
    """The file at path, grown to size bytes (zeros), mapped shared."""
    with path.open("ab") as file:
        file.truncate(size)
    with path.open("r+b") as file:
        return mmap.mmap(file.fileno(), size)


def test_tensors_in_a_dev_shm_file_are_read_in_place_from_it_and_others_copied():
    """The stub's end lends tensors that lie in a /dev/shm file (where Triton keeps a request's inputs): the receiver
    maps the file and reads them there, seeing later writes; a message with any other tensor travels in a region."""
    with lending_links_and_file("in-place") as (sender, receiver, path):
        in_file = torch.frombuffer(mapped(path, 1 << 20), dtype=torch.bfloat16)
        x, ids = in_file[4096:4096 + 512 * 64].view(512, 64), in_file[64:64 + 14].view(7, 2)
        x.copy_(torch.randn(512, 64))
        ids.copy_(torch.arange(14).view(7, 2))
        sender.send({"id": 1}, {"x": x, "ids": ids})
        message = receiver.receive()
        arrived = message["tensors"]
        assert torch.equal(arrived["x"], x) and torch.equal(arrived["ids"], ids)
        assert f"{path}" in Path("/proc/self/maps").read_text()
        x[0, 0] = 7.0  # read in place: the receiver sees the sender's memory, not a copy of it
        assert arrived["x"][0, 0] == 7.0 and arrived["x"].data_ptr() != x.data_ptr()
        sender.send({"id": 2}, {"x": x, "other": torch.ones(3)})  # not all in the file: copied into a region
        copied = receiver.receive()["tensors"]
        x[0, 0] = 8.0
        assert copied["x"][0, 0] == 7.0 and torch.equal(copied["other"], torch.ones(3))


def test_a_lent_file_that_has_grown_is_mapped_again_and_earlier_tensors_stay_readable():
    """Triton's Python backend grows its shared memory file when a request needs more: the receiver maps the file
    again for tensors beyond its first mapping, and keeps the first one for the tensors still read from it."""
    with lending_links_and_file("grow") as (sender, receiver, path):
        first = torch.frombuffer(mapped(path, 1 << 16), dtype=torch.float32)[:1024]
        first.copy_(torch.arange(1024.0))
        sender.send({"id": 1}, {"x": first})
        early = receiver.receive()["tensors"]["x"]
        beyond = torch.frombuffer(mapped(path, 1 << 20), dtype=torch.float32)[(1 << 18) - 2048:]  # past 64 KiB
        beyond.copy_(torch.full((2048,), 5.0))
        sender.send({"id": 2}, {"x": beyond})
        late = receiver.receive()["tensors"]["x"]
        assert torch.equal(late, torch.full((2048,), 5.0))
        assert torch.equal(early, torch.arange(1024.0))
