"""Named tensors between a rank's stub and its worker process, in anonymous shared memory, never through a socket.

The sender copies the tensors into one new memfd (anonymous memory: it has no name in /dev/shm, so no crash can
leave it behind), and sends a small JSON header over the link with the file descriptor beside it (SCM_RIGHTS).
The receiver maps the memory and reads the tensors in place. The memory goes back to the system once both sides
have dropped it: the sender closes its descriptor after sending, the receiver's tensors hold its mapping.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import torch

from mdtriton.engine.dtypes import TORCH_DTYPES, TRITON_TYPES

ALIGNMENT = 64  # each tensor starts on a cache line, as torch's own CPU allocations do


def _pack(tensors: dict[str, torch.Tensor]) -> tuple[int, list]:
    """Copy tensors (on any device) into a new memfd; its descriptor and the specs [name, data type, shape, offset]."""
    specs, size = [], 0
    for name, tensor in tensors.items():
        specs.append([name, TRITON_TYPES[tensor.dtype], list(tensor.shape), size])
        size += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    descriptor = os.memfd_create("mdtriton-tensors", os.MFD_CLOEXEC)
    try:
        os.ftruncate(descriptor, max(size, ALIGNMENT))
        for (_, _, _, offset), tensor in zip(specs, tensors.values()):
            # write(2), not a copy into a mapping: the kernel fills the new pages without a page fault for each.
            data = memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
            while data:
                written = os.pwrite(descriptor, data, offset)
                data, offset = data[written:], offset + written
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor, specs


def _unpack(descriptor: int, specs: list) -> dict[str, torch.Tensor]:
    """The tensors described by specs, read in place from the memory of `descriptor` (which is closed)."""
    try:
        # Populated at once: one call maps every page, instead of a fault per page as the tensors are read.
        memory = mmap.mmap(descriptor, os.fstat(descriptor).st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(descriptor)
    tensors = {}
    for name, data_type, shape, offset in specs:
        dtype = TORCH_DTYPES[data_type]
        count = 1
        for extent in shape:
            count *= extent
        # The tensor keeps the mapping alive; it is unmapped when the last tensor on it goes.
        tensors[name] = (torch.frombuffer(memory, dtype=dtype, count=count, offset=offset).view(shape) if count
                         else torch.empty(shape, dtype=dtype))
    return tensors


class TensorLink:
    """One end of the stub-worker connection (a Unix socket pair): JSON messages, some carrying named tensors."""

    def __init__(self, connection: Connection):
        self._connection = connection
        self._send_lock = threading.Lock()  # a message and its descriptor go out together

    def send(self, message: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Send message; tensors, if given, travel in shared memory and come back as message["tensors"]."""
        if tensors is None:
            with self._send_lock:
                self._connection.send_bytes(json.dumps(message).encode())
            return
        descriptor, specs = _pack(tensors)
        try:
            with self._send_lock:
                self._connection.send_bytes(json.dumps({**message, "tensor_specs": specs}).encode())
                send_handle(self._connection, descriptor, 0)
        finally:
            os.close(descriptor)

    def receive(self) -> dict:
        """The next message, with its tensors under "tensors" if it carried some; EOFError when the other side is gone."""
        message = json.loads(self._connection.recv_bytes())
        if "tensor_specs" in message:
            message["tensors"] = _unpack(recv_handle(self._connection), message.pop("tensor_specs"))
        return message

    def poll(self, timeout: float) -> bool:
        return self._connection.poll(timeout)

    def fileno(self) -> int:
        return self._connection.fileno()

    def close(self) -> None:
        self._connection.close()
