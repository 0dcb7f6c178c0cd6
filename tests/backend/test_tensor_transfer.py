"""Tensors between a stub and its worker: every data type and shape arrives equal, through memory that has no
name in /dev/shm (nothing a crash could leave behind) and is given back once dropped."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from multiprocessing.connection import Connection

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


def test_tensors_arrive_equal_in_place_and_leave_nothing_in_dev_shm():
    sender, receiver = link_pair()
    shm_before = set(os.listdir("/dev/shm"))
    tensors = {"hidden_states": torch.randn(2, 9, 64), "timestep": torch.rand(3, dtype=torch.bfloat16),
               "ids": torch.arange(7, dtype=torch.int64).reshape(7, 1), "odd": torch.randn(5, 3)[:, 1]}
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
    assert "memfd:mdtriton-tensors" in Path("/proc/self/maps").read_text()
    del message, arrived
    assert open_memfds() == []  # the memfd was closed on both sides once mapped
    assert "memfd:mdtriton-tensors" not in Path("/proc/self/maps").read_text()  # and unmapped with its tensors
    sender.close()
    receiver.close()
