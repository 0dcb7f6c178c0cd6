"""Named tensors between a rank's stub and its worker process, in anonymous shared memory, never through a socket.

Each end of a link sends tensors through *regions* of its own: anonymous memory (a memfd: it has no name in
/dev/shm, so no crash can leave it behind), mapped once by both processes (its descriptor crosses the socket, by
SCM_RIGHTS, beside the first message that uses it) and reused by later messages. A fresh memfd per message cost
far more than the copy itself (new pages zeroed, mapped and unmapped every time: 3 ms against 0.15 ms for
a 5 MiB request's inputs (a 1024x1024 image's transformer call) on a 2-core box). A region holds one message's tensors and is lent to the receiver,
which reads them in place; once the receiver has dropped every tensor of that message, it names the region in its
next message to the sender, which then reuses it. Only small JSON headers go through the socket.

Tensors that already lie in a shared memory file of /dev/shm need no region: a request's inputs do, in the stub,
where Triton's Python backend keeps them in its own region of /dev/shm until the request is answered. An end made
with `lends_shared_files` (the stub's) names such a tensor's file and offset (found in /proc/self/maps), and the
receiver maps that file and reads the tensor in place: a 5 MiB request's inputs are then not copied by the
stub at all (a 1 ms copy on the GPU hosts). The sender must keep those tensors unchanged until the receiver is
done with them (the stub holds each request until it is answered).

A GPU rank's worker page-locks the regions and files it maps (`pinned`), so that its copies to and from the GPU
run at full speed and the input copies can be asynchronous.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import mmap
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np
import torch

from mdtriton.engine.dtypes import TORCH_DTYPES, TRITON_TYPES

log = logging.getLogger("mdtriton.backend")

ALIGNMENT = 64  # each tensor starts on a cache line, as torch's own CPU allocations do
# Regions are at least this big and grow in powers of two, so requests of slightly different shapes reuse them.
MIN_REGION_BYTES = 1 << 16
SHARED_FILES = "/dev/shm/"


def region_size(byte_size: int) -> int:
    """The size of a new region for byte_size bytes: the next power of two, at least MIN_REGION_BYTES."""
    return max(MIN_REGION_BYTES, 1 << max(byte_size - 1, 0).bit_length())


def layout(tensors: dict[str, torch.Tensor]) -> tuple[list, int]:
    """The specs [name, data type, shape, offset] of tensors packed one after another, and the bytes they take."""
    specs, size = [], 0
    for name, tensor in tensors.items():
        specs.append([name, TRITON_TYPES[tensor.dtype], list(tensor.shape), size])
        size += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    return specs, size


def shared_file_spans() -> list[tuple[int, int, int, str]]:
    """This process's shared mappings of /dev/shm files: (start address, end address, offset in the file, path)."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[1][3] == "s" and fields[5].startswith(SHARED_FILES):
                path = fields[5].rstrip("\n")
                if os.path.isfile(path):  # not " (deleted)"
                    start, end = (int(address, 16) for address in fields[0].split("-"))
                    spans.append((start, end, int(fields[2], 16), path))
    return spans


class SharedFiles:
    """Where this process's memory lies in the shared files of /dev/shm that it has mapped."""

    def __init__(self):
        self._spans: list[tuple[int, int, int, str]] = []

    def locate(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        """(path, offset in the file) of a contiguous CPU tensor's bytes, or None if they are not in such a file."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            return None
        address, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        for refreshed in (False, True):
            if refreshed:  # a file mapped (or mapped again, grown) since the last look
                self._spans = shared_file_spans()
            for start, stop, offset, path in self._spans:
                if start <= address and end <= stop:
                    return path, offset + address - start
        return None


@dataclass
class Region:
    """One of this end's regions: its number on this link, its bytes, and its descriptor until the peer has it."""

    number: int
    memory: mmap.mmap
    data: torch.Tensor  # the same memory as uint8
    descriptor: int | None


def map_region(descriptor: int, byte_size: int, pinned: bool) -> mmap.mmap:
    """Map a region's memory, every page at once (one call instead of a fault per page). The mapping keeps a
    duplicate of the descriptor (Python's mmap does) until it is unmapped."""
    memory = mmap.mmap(descriptor, byte_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    if pinned:
        pin(memory)
    return memory


def pin(memory: mmap.mmap) -> None:
    """Page-lock memory for CUDA copies; a failure only costs speed (the copies then go through staging buffers).
    The memory stays registered as long as the worker lives (its regions are kept for reuse until it exits)."""
    address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
    status = int(torch.cuda.cudart().cudaHostRegister(address, len(memory), 0))
    if status != 0:
        log.warning("could not page-lock %d bytes of shared memory for CUDA copies (cudaError %d); copies to and "
                    "from the GPU will be slower", len(memory), status)


class TensorLink:
    """One end of the stub-worker connection (a Unix socket pair): JSON messages, some carrying named tensors.

    pinned: page-lock every region and file this end maps (a GPU rank's worker).
    lends_shared_files: send tensors that lie in /dev/shm files as their place in the file, not as copies (the stub:
    it holds each request's inputs until the request is answered)."""

    def __init__(self, connection: Connection, pinned: bool = False, lends_shared_files: bool = False):
        self._connection = connection
        self._pinned = pinned
        self._shared_files = SharedFiles() if lends_shared_files else None
        # The /dev/shm files the peer lent tensors of, mapped here: path -> mappings, the latest (the largest) last.
        # Older ones are kept: they may be page-locked, and tensors may still be read from them.
        self._files: dict[str, list[mmap.mmap]] = {}
        self._send_lock = threading.Lock()  # a message and its descriptor go out together
        self._regions_lock = threading.Lock()  # guards this end's free and lent regions
        self._free: list[Region] = []
        self._lent: dict[int, Region] = {}
        self._numbers = itertools.count()
        self._peer_regions: dict[int, mmap.mmap] = {}  # the peer's regions, mapped here (read by the receiving thread)
        # The peer's regions whose tensors this end has dropped: appended by finalizers (any thread, no lock),
        # named in this end's next message.
        self._dropped: deque[int] = deque()

    def send(self, message: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Send message; tensors (on any device), if given, travel in one of this end's regions and come back as
        message["tensors"]."""
        if tensors is None:
            with self._send_lock:
                self._send_header(message)
            return
        if self._shared_files is not None:
            places = [self._shared_files.locate(tensor) for tensor in tensors.values()]
            if all(places):
                specs = [[name, TRITON_TYPES[tensor.dtype], list(tensor.shape), path, offset]
                         for (name, tensor), (path, offset) in zip(tensors.items(), places)]
                with self._send_lock:
                    self._send_header({**message, "file_tensors": specs})
                return
        specs, size = layout(tensors)
        region = self._take(size)
        try:
            for (_, _, _, offset), tensor in zip(specs, tensors.values()):
                end = offset + tensor.numel() * tensor.element_size()
                if tensor.device.type == "cpu":
                    # A plain memcpy: torch's copy runs on its thread pool, whose threads keep spinning afterwards on
                    # the cores the other process needs (it made a 5 MiB hop 8-16 ms instead of 0.8 on 2 cores).
                    region.memory[offset:end] = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                else:  # a copy from the GPU, straight into the region
                    region.data[offset:end].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        except BaseException:
            self._give_back([region.number])
            raise
        header = {**message, "tensor_specs": specs, "region": region.number}
        with self._send_lock:
            if region.descriptor is None:
                self._send_header(header)
                return
            self._send_header({**header, "region_bytes": len(region.data)})
            send_handle(self._connection, region.descriptor, 0)
            os.close(region.descriptor)  # both sides have it mapped now
            region.descriptor = None

    def receive(self) -> dict:
        """The next message, with its tensors under "tensors" if it carried some; EOFError when the other side is gone.

        The tensors are read in place from the sender's region, which is not reused before all of them are dropped."""
        message = json.loads(self._connection.recv_bytes())
        self._give_back(message.pop("dropped", ()))
        if "tensor_specs" in message:
            number = message.pop("region")
            if "region_bytes" in message:
                descriptor = recv_handle(self._connection)
                try:
                    self._peer_regions[number] = map_region(descriptor, message.pop("region_bytes"), self._pinned)
                finally:
                    os.close(descriptor)
            message["tensors"] = self._views(number, message.pop("tensor_specs"))
        elif "file_tensors" in message:
            message["tensors"] = {name: self._file_view(path, offset, TORCH_DTYPES[data_type], shape)
                                  for name, data_type, shape, path, offset in message.pop("file_tensors")}
        return message

    def poll(self, timeout: float) -> bool:
        return self._connection.poll(timeout)

    def fileno(self) -> int:
        return self._connection.fileno()

    def close(self) -> None:
        """Close the connection; the regions are unmapped once nothing refers to them any more."""
        self._connection.close()

    def _send_header(self, message: dict) -> None:
        """Send one JSON header (under the send lock), naming the peer's regions this end has finished with."""
        dropped = []
        while self._dropped:
            dropped.append(self._dropped.popleft())
        if dropped:
            message = {**message, "dropped": dropped}
        self._connection.send_bytes(json.dumps(message).encode())

    def _take(self, byte_size: int) -> Region:
        """A free region of at least byte_size bytes (the smallest), or a new one; lent until the peer gives it back."""
        with self._regions_lock:
            fitting = [region for region in self._free if len(region.data) >= byte_size]
            if fitting:
                region = min(fitting, key=lambda r: len(r.data))
                self._free.remove(region)
                self._lent[region.number] = region
                return region
        size = region_size(byte_size)
        descriptor = os.memfd_create("mdtriton-tensors", os.MFD_CLOEXEC)
        try:
            os.ftruncate(descriptor, size)
            memory = map_region(descriptor, size, self._pinned)
        except BaseException:
            os.close(descriptor)
            raise
        region = Region(next(self._numbers), memory, torch.frombuffer(memory, dtype=torch.uint8), descriptor)
        with self._regions_lock:
            self._lent[region.number] = region
        return region

    def _give_back(self, numbers) -> None:
        with self._regions_lock:
            for number in numbers:
                self._free.append(self._lent.pop(number))

    def _file_view(self, path: str, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """A tensor read in place from a /dev/shm file of the peer's, mapped here once (again if it has grown)."""
        end = offset + math.prod(shape) * dtype.itemsize
        mappings = self._files.setdefault(path, [])
        if not mappings or len(mappings[-1]) < end:
            descriptor = os.open(path, os.O_RDWR)
            try:
                mappings.append(map_region(descriptor, os.fstat(descriptor).st_size, self._pinned))
            finally:
                os.close(descriptor)
        memory = np.frombuffer(mappings[-1], dtype=np.uint8, count=end - offset, offset=offset)
        return torch.from_numpy(memory).view(dtype).view(shape)

    def _views(self, number: int, specs: list) -> dict[str, torch.Tensor]:
        """The tensors of one message, in place in the peer's region `number`; when the last of them is dropped the
        region is named in this end's next message, so the peer may reuse it."""
        # One array per message over the whole region: every tensor of the message keeps it alive, and its
        # finalizer runs when the last one goes (whichever thread drops it: it only appends to a deque).
        memory = np.frombuffer(self._peer_regions[number], dtype=np.uint8)
        weakref.finalize(memory, self._dropped.append, number)
        tensors = {}
        for name, data_type, shape, offset in specs:
            dtype = TORCH_DTYPES[data_type]
            byte_size = math.prod(shape) * dtype.itemsize
            tensors[name] = torch.from_numpy(memory[offset:offset + byte_size]).view(dtype).view(shape)
        return tensors
