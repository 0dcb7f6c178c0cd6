"""The engine interface the backend serves, and its PyTorch implementation.

An engine is loaded by its class's `load(engine_dir, manifest, architecture, comm)` (mdtriton.serving.load_engine
picks the class by the manifest's architecture and hands it the family: mdtriton.engine.architecture); the caller has
read the manifest and made the rank's Communicator, which it keeps (the backend forms the groups and broadcasts inputs
and answers with it). After that the backend needs only `manifest` and `forward`; a TensorRT runner can implement the
same class. Every rank of the plan calls `forward` with the same inputs, together; each gets the full outputs.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mdtriton.engine.architecture import Architecture
from mdtriton.engine.attention import fa3
from mdtriton.engine.comm import Communicator
from mdtriton.engine.compile import CompileCache, compile_and_warm_up
from mdtriton.engine.cuda_graphs import GraphedForward, eager_forward
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.fp8 import Fp8Unsupported, check_fp8_device
from mdtriton.engine.group_times import GroupTimes, measure_group_times
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.memory import check_fits
from mdtriton.engine.modules import loaded_module
from mdtriton.engine.step_cache import StepCache

log = logging.getLogger(__name__)


class Engine(ABC):
    """One rank's share of a multi-device engine."""

    manifest: Manifest  # the manifest it was loaded from
    warm_up_seconds: float = 0.0  # how long its load spent warming up (compiling) after the weights were in place

    @abstractmethod
    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the model on inputs (by name); all ranks call this together, in the same order. The outputs are on the
        communicator's device (mdtriton.engine.comm, the device contract): the backend may broadcast them."""

    def request_tokens(self, inputs: dict[str, torch.Tensor]) -> int | None:
        """The tokens a request's transformer forwards run over (inputs already checked), by which an elastic model's
        job hub sizes a lone request's group; None where the engine cannot tell (the request then takes the largest
        free group)."""
        return None

    def measure_group_times(self) -> GroupTimes | None:
        """An elastic plan's table of forward times by group size (mdtriton.engine.group_times), measured now: every
        rank calls this together, once the ranks have met. None where the engine has no transformer of ours to time."""
        return None


class TorchEngine(Engine):
    """An engine run by PyTorch: the architecture module with this rank's weights on its device.

    On GPUs its blocks are compiled (torch.compile, the regions between collectives) and warmed up inside
    `load`, at two lengths so that one graph with a symbolic length serves every later request: no request
    waits for a compile. Short requests then replay CUDA graphs (mdtriton.engine.cuda_graphs). The compiled artifacts
    are kept in the engine directory (CompileCache), so a later load on the same kind of GPU and torch takes
    seconds instead of minutes.
    """

    def __init__(self, manifest: Manifest, architecture: Architecture, module: torch.nn.Module, comm: Communicator,
                 load_seconds: float, warm_up_seconds: float, compiled: bool):
        self.manifest = manifest
        self.architecture = architecture
        self.module = module
        self.comm = comm
        self.load_seconds = load_seconds
        self.warm_up_seconds = warm_up_seconds
        self.run = device_forward(module, architecture, manifest.config, compiled, comm)

    @classmethod
    def load(cls, engine_dir: Path, manifest: Manifest, architecture: Architecture, comm: Communicator,
             compile: bool | None = None) -> "TorchEngine":
        """Check the manifest (read from engine_dir by the caller) against its family (architecture), the communicator
        and the device, load this rank's weights only (safetensors maps the file and copies it straight to the device),
        then compile and warm up. load_seconds and warm_up_seconds say how long each part took.

        compile: None compiles on GPUs only (CPU ranks run eagerly: they serve tests and checks).
        """
        start = time.perf_counter()
        engine_dir = Path(engine_dir)
        if manifest.plan != comm.plan:
            raise EngineError(f"{engine_dir}: engine was built for {manifest.plan}, but is being loaded on {comm.plan}")
        if manifest.architecture != architecture.name:
            raise EngineError(f"{engine_dir}: a {manifest.architecture} engine, loaded as {architecture.name}")
        if manifest.quantization == "fp8":
            try:
                check_fp8_device(comm.device)
            except Fp8Unsupported as error:
                raise EngineError(f"{engine_dir}: {error}") from None
        path = manifest.weight_file(engine_dir, comm.rank)
        if comm.device.type == "cuda":
            check_fits(manifest, architecture, comm.device.index, torch.cuda.mem_get_info(comm.device)[0], "free")
            reason = fa3.unavailable_reason(comm.device)
            log.info("rank %d: attention by %s", comm.rank,
                     "FlashAttention-3" if reason is None else f"torch's SDPA (not FlashAttention-3: {reason})")
        try:
            weights = load_file(path, device=str(comm.device))
        except SafetensorError as error:
            raise EngineError(f"{path}: not a readable safetensors file: {error}") from error
        try:
            return cls.from_weights(manifest, architecture, comm, weights, CompileCache(engine_dir, comm), compile,
                                    start)
        except EngineError as error:
            raise EngineError(f"{path}: {error}") from error

    @classmethod
    def from_weights(cls, manifest: Manifest, architecture: Architecture, comm: Communicator,
                     weights: dict[str, torch.Tensor], cache: CompileCache | None = None, compile: bool | None = None,
                     start: float | None = None) -> "TorchEngine":
        """This rank's engine from its weights (on its device, as `load` reads them from its weight file): the module,
        then on GPUs its compile and warm-up, which `cache` (if any) keeps. What `load` does once the file is read;
        benchmarks call it with weights made in memory, so they time what the server runs."""
        start = time.perf_counter() if start is None else start
        module = loaded_module(architecture, manifest.config, comm, weights, manifest.quantization)
        weights.clear()  # the module holds the tensors now
        load_seconds = time.perf_counter() - start
        warm_up_seconds = 0.0
        compiled = compile if compile is not None else comm.device.type == "cuda"
        if compiled:
            if cache is not None:
                cache.load()
            warm_up_seconds = compile_and_warm_up(module, architecture, manifest.config,
                                                  TORCH_DTYPES[manifest.data_type], comm)
            if cache is not None:
                cache.save()
        return cls(manifest, architecture, module, comm, load_seconds, warm_up_seconds, compiled)

    def forward(self, inputs: dict[str, torch.Tensor], cache: StepCache | None = None) -> dict[str, torch.Tensor]:
        """The outputs of inputs; cache: the request's step cache (pipelines), which runs the forward as its method
        says and counts the calls that ran every block."""
        with torch.inference_mode():
            on_device = {name: tensor.to(self.comm.device, non_blocking=True) for name, tensor in inputs.items()}
            return self.run(on_device) if cache is None else cache.forward(self.run, on_device, self.comm)

    def request_tokens(self, inputs: dict[str, torch.Tensor]) -> int:
        """The request's tokens, as the family counts them (FLUX: text plus image)."""
        return self.architecture.request_size(self.manifest.config, inputs).tokens

    def measure_group_times(self, max_tokens: int | None = None, calls=lambda size: 1) -> GroupTimes:
        """The forward's times on the family's example requests of up to max_tokens tokens (None: this engine's limit;
        a pipeline's is its own); calls: as measure_group_times takes it."""
        dtype = TORCH_DTYPES[self.manifest.data_type]
        return measure_group_times(self.forward, lambda tokens: self.architecture.example_request(
            self.manifest.config, tokens, dtype), self.comm, max_tokens or self.manifest.limits.max_tokens, calls)


def device_forward(module: torch.nn.Module, architecture: Architecture, config: dict, compiled: bool,
                   comm: Communicator):
    """How module runs requests (inputs by name, on its device): compiled on a GPU, short requests through CUDA
    graphs (GraphedForward), collectives included (every rank captures the same job's graph together); otherwise
    as it is (eager_forward). Either is called as run(inputs), or run(inputs, part, carried) for a part of the forward
    (mdtriton.engine.step_cache). Benchmarks time it through TorchEngine.forward (mdtriton/harness.py). comm: the
    engine's, whose ranks (those of the group it is bound to, for an elastic plan's job) key the graphs."""
    if compiled and next(module.parameters()).is_cuda:
        def request_size(inputs: dict[str, torch.Tensor]) -> int:
            size = architecture.request_size(config, inputs)
            return size.batch * size.tokens

        return GraphedForward(module, request_size, lambda: tuple(comm.members))
    return eager_forward(module)
