"""Run a function on N real ranks (separate processes, gloo process group) and collect results.

The ranks start as the harness's do (mdtriton.harness.RANK_PROCESSES: forked from a fork server that has imported
torch once for the whole session), each with its parent's environment at the call."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from mdtriton.harness import RANK_PROCESSES, rank_environment


def _rank_main(rank, world_size, work_dir, fn, args):
    try:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(work_dir, "store"), world_size),
                                rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - report any failure to the parent with its traceback
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(work_dir, f"result{rank}"), "wb") as file:
        pickle.dump(result, file)


def run_ranks(world_size: int, fn, *args, timeout: float = 300):
    """Call fn(rank, world_size, *args) on world_size gloo ranks; return the results in rank order.

    fn must be importable (a module-level function). Raises if any rank fails or times out.
    """
    with tempfile.TemporaryDirectory() as work_dir:
        procs = [RANK_PROCESSES.Process(target=rank_environment,
                                     args=(rank, dict(os.environ), _rank_main, world_size, work_dir, fn, args))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout)
        stuck = [proc for proc in procs if proc.is_alive()]
        for proc in stuck:
            proc.kill()
        if stuck:
            raise TimeoutError(f"{len(stuck)} rank(s) did not finish within {timeout} s")
        out = []
        for rank, proc in enumerate(procs):
            result_file = Path(work_dir) / f"result{rank}"
            status, value = (pickle.loads(result_file.read_bytes()) if result_file.exists()
                             else ("error", f"rank {rank} exited with code {proc.exitcode}"))
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out.append(value)
        return out
