"""Run a function on N real ranks (separate processes, gloo process group) and collect results.

The ranks start as the harness's do (mdtriton.harness.run_ranks: forked from a fork server that has imported torch
once for the whole test session, each with its parent's environment at the call, its process group begun by init_rank);
each rank hands its result back in a file."""

from __future__ import annotations

import pickle
import tempfile
import traceback
from pathlib import Path

import torch.distributed as dist

from mdtriton import harness

GROUP_TIMEOUT_S = 120  # a collective that waits this long for a peer fails


def _rank_main(rank: int, world_size: int, port: int, work_dir: str, fn, args: tuple) -> None:
    try:
        harness.init_rank(rank, world_size, port, cuda=False, group_of_one=True, timeout_s=GROUP_TIMEOUT_S)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - report any failure to the parent with its traceback
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (Path(work_dir) / f"result{rank}").write_bytes(pickle.dumps(result))


def run_ranks(world_size: int, fn, *args, timeout: float = 300):
    """Call fn(rank, world_size, *args) on world_size gloo ranks; return the results in rank order.

    fn must be importable (a module-level function). Raises if any rank fails, or does not finish within timeout
    seconds (every rank is then stopped).
    """
    with tempfile.TemporaryDirectory() as work_dir:
        problem = harness.run_ranks(_rank_main, world_size, (work_dir, fn, args), time_limit=timeout)
        if problem:
            raise RuntimeError(problem)
        out = []
        for rank in range(world_size):
            status, value = pickle.loads((Path(work_dir) / f"result{rank}").read_bytes())
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out.append(value)
        return out
