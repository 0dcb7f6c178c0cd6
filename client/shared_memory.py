"""Shared memory for large tensors: they pass through memory the server maps instead of through gRPC.

System shared memory (POSIX, /dev/shm) works when client and server share a host (and /dev/shm);
CUDA shared memory (CUDA IPC, needs `cuda-python`) when they share a GPU host. One region holds one
tensor, at offset 0. Regions are registered with the server once and reused by later requests
(registering costs an RPC and an mmap on the server); `close()` unregisters and unlinks every one,
so nothing is left under /dev/shm.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as system_shm

# Regions are at least this big and grow in powers of two, so slightly different shapes reuse them.
MIN_REGION_BYTES = 1 << 16
_region_numbers = itertools.count()


def region_size(byte_size: int) -> int:
    """The region size for a tensor of byte_size: the next power of two, at least MIN_REGION_BYTES."""
    return max(MIN_REGION_BYTES, 1 << max(byte_size - 1, 0).bit_length())


@dataclass
class Region:
    name: str  # the name the server knows it by
    byte_size: int
    handle: object  # tritonclient's handle (system or CUDA)


class RegionPool:
    """Registered regions of one kind ("system", or "cuda" on one GPU), lent out one request at a time.

    Thread-safe: concurrent requests each take their own regions. headers: those that carry the server's key
    (client/server_key.py), sent with every registration.
    """

    def __init__(self, server: grpcclient.InferenceServerClient, kind: str, device_id: int = 0,
                 headers: dict[str, str] | None = None):
        if kind not in ("system", "cuda"):
            raise ValueError(f"shared memory kind is 'system' or 'cuda', got {kind!r}")
        self.server = server
        self.kind = kind
        self.device_id = device_id
        self.headers = headers
        self._free: list[Region] = []
        self._all: list[Region] = []
        self._lock = threading.Lock()
        self._cuda = _cuda_shm() if kind == "cuda" else None

    def take(self, byte_size: int) -> Region:
        """A registered region of at least byte_size bytes: the smallest free one that fits, or a new one."""
        with self._lock:
            fitting = [region for region in self._free if region.byte_size >= byte_size]
            if fitting:
                region = min(fitting, key=lambda r: r.byte_size)
                self._free.remove(region)
                return region
        region = self._create(region_size(byte_size))
        with self._lock:
            self._all.append(region)
        return region

    def give_back(self, region: Region) -> None:
        with self._lock:
            self._free.append(region)

    def _create(self, byte_size: int) -> Region:
        name = f"mdtriton_{os.getpid()}_{next(_region_numbers)}"
        if self.kind == "system":
            key = "/" + name
            handle = system_shm.create_shared_memory_region(name, key, byte_size, create_only=True)
            try:
                self.server.register_system_shared_memory(name, key, byte_size, headers=self.headers)
            except BaseException:
                system_shm.destroy_shared_memory_region(handle)
                raise
        else:
            handle = self._cuda.create_shared_memory_region(name, byte_size, self.device_id)
            try:
                self.server.register_cuda_shared_memory(name, self._cuda.get_raw_handle(handle), self.device_id,
                                                        byte_size, headers=self.headers)
            except BaseException:
                self._cuda.destroy_shared_memory_region(handle)
                raise
        return Region(name, byte_size, handle)

    def write(self, region: Region, value) -> None:
        """Copy one tensor into the region: a numpy array, or (CUDA) anything with __dlpack__, e.g. a torch tensor."""
        if self.kind == "system":
            system_shm.set_shared_memory_region(region.handle, [np.ascontiguousarray(value)])
        elif isinstance(value, np.ndarray):
            self._cuda.set_shared_memory_region(region.handle, [np.ascontiguousarray(value)])
        else:
            self._cuda.set_shared_memory_region_from_dlpack(region.handle, [value.contiguous()])

    def read(self, region: Region, dtype: np.dtype, shape: list[int]) -> np.ndarray:
        """A copy of the tensor the server wrote into the region (a copy: the region goes back to the pool)."""
        if self.kind == "system":
            return np.array(system_shm.get_contents_as_numpy(region.handle, dtype, shape))
        return np.array(self._cuda.get_contents_as_numpy(region.handle, dtype, shape))

    def close(self) -> None:
        """Unregister every region from the server and free (unlink) it, even if the server is gone."""
        with self._lock:
            regions, self._all, self._free = self._all, [], []
        for region in regions:
            try:
                if self.kind == "system":
                    self.server.unregister_system_shared_memory(region.name, headers=self.headers)
                else:
                    self.server.unregister_cuda_shared_memory(region.name, headers=self.headers)
            except grpcclient.InferenceServerException:
                pass  # the server is gone or restarted: it holds no registration any more
            finally:
                if self.kind == "system":
                    system_shm.destroy_shared_memory_region(region.handle)
                else:
                    self._cuda.destroy_shared_memory_region(region.handle)


@functools.cache
def cuda_shared_memory_available() -> bool:
    """Whether tritonclient's CUDA shared memory can be used here (it needs cuda-python); says why once if not."""
    try:
        _cuda_shm()
    except RuntimeError as error:
        logging.getLogger("mdtriton.client").warning("%s; CUDA tensors go through host memory", error)
        return False
    return True


def _cuda_shm():
    try:
        import tritonclient.utils.cuda_shared_memory as cuda_shm
    except RuntimeError as error:  # what tritonclient raises when cuda-python is missing
        raise RuntimeError("CUDA shared memory needs cuda-python: pip install 'mdtriton[cuda]'") from error
    return cuda_shm
