"""Compiling an engine on its GPU at load, so that no request waits for a compile.

The module names the regions worth compiling (FLUX: its blocks); each is compiled with torch.compile
with symbolic sizes, its attention and collectives running eagerly in between (graph breaks). Every block of
a kind shares one compiled code. The warm-up runs the whole model alone, before the ranks meet
(Communicator.rehearsal), on the family's warm-up requests: for FLUX, batch 7 first, whose graphs serve every
batch of 2 or more and any length, then batch 1 (a size-1 dimension is always specialised), whose graphs serve
any length. After that no request compiles. A CompileCache keeps what was compiled in the engine directory, per torch
version and GPU model.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import torch

from mdtriton.engine.architecture import Architecture
from mdtriton.engine.comm import Communicator

log = logging.getLogger(__name__)

CACHE_DIR = "compile-cache"


def compile_and_warm_up(module: torch.nn.Module, architecture: Architecture, config: dict, dtype: torch.dtype,
                        comm: Communicator) -> float:
    """Compile each of the module's compiled_regions() in place (symbolic batch and sequence sizes), then run the
    module on this rank alone on its family's warm-up requests, which compiles them; return the seconds the warm-up
    took. An elastic plan's module is warmed up at every group size it may run a job at (comm bound to each group:
    other sizes of the sequence slices, other collectives), so that no request waits for a compile."""
    for region in module.compiled_regions():
        region.compile(dynamic=True)
    start = time.perf_counter()
    requests = architecture.warm_up_requests(config, dtype)
    # Deterministic: Inductor picks its kernels' configurations without timing them on the device, so every
    # process (a healed worker, a later load) runs the same kernels and computes the same bits for the same inputs.
    for size in comm.plan.group_sizes():
        size_start = time.perf_counter()
        with (comm.bound_to(size), comm.rehearsal(), torch.inference_mode(),
              torch._inductor.config.patch(deterministic=True)):
            for inputs in requests:
                module(**{name: tensor.to(comm.device) for name, tensor in inputs.items()})
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        if comm.plan.elastic:  # what each group size adds to the load (docs/architecture.md, "Elastic groups")
            log.info("rank %d warmed up on groups of %d rank%s in %.2f s", comm.rank, size, "s" if size > 1 else "",
                     time.perf_counter() - size_start)
    return time.perf_counter() - start


class CompileCache:
    """What torch.compile made for one rank of an engine (Inductor's code, Triton kernels, autotuning choices),
    kept in ENGINE_DIR/compile-cache/ so that the next load skips the compile.

    Valid for one torch version and one GPU model, which the file name holds. A read-only engine directory
    only costs the next load its compile again.
    """

    def __init__(self, engine_dir: Path, comm: Communicator):
        device = torch.cuda.get_device_name(comm.device) if comm.device.type == "cuda" else "cpu"
        key = re.sub(r"[^A-Za-z0-9.]+", "-", f"torch-{torch.__version__}-{device}")
        self.path = Path(engine_dir) / CACHE_DIR / f"{key}-rank{comm.rank}.bin"
        self.loaded = False

    def load(self) -> None:
        """Give torch the artifacts kept here, if any (before compiling)."""
        if self.path.is_file():
            torch.compiler.load_cache_artifacts(self.path.read_bytes())
            self.loaded = True

    def save(self) -> None:
        """Keep what this process compiled, unless it came from here already."""
        if self.loaded:
            return
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return
        try:
            self.path.parent.mkdir(exist_ok=True)
            partial = self.path.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(artifacts[0])
            partial.replace(self.path)
        except OSError as error:
            log.warning("could not keep the compiled engine in %s (%s): the next load compiles again",
                        self.path, error)
