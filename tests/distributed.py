"""Run a function on N real ranks (separate processes, gloo process group) and collect results."""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank, world_size, store_path, fn, args, results):
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - report any failure to the parent with its traceback
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 300):
    """Call fn(rank, world_size, *args) on world_size gloo ranks; return the results in rank order.

    fn must be importable (a module-level function). Raises if any rank fails or times out.
    """
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, context.Manager() as manager:
        results = manager.dict()
        procs = [context.Process(target=_rank_main, args=(r, world_size, os.path.join(tmp, "store"), fn, args, results))
                 for r in range(world_size)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                raise TimeoutError(f"a rank did not finish within {timeout} s")
        out = []
        for rank in range(world_size):
            status, value = results.get(rank, ("error", f"rank {rank} exited with code {procs[rank].exitcode}"))
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out.append(value)
        return out
