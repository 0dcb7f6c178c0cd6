"""The engine interface the backend serves, and its PyTorch implementation.

The backend needs only `manifest` and `forward`; a TensorRT runner can implement the same class.
Every rank of the plan calls `forward` with the same inputs, together; each gets the full outputs.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mdtriton.engine.architectures import architecture
from mdtriton.engine.comm import Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.memory import check_fits


class Engine(ABC):
    """One rank's share of a multi-device engine."""

    manifest: Manifest

    @abstractmethod
    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the model on inputs (by name); all ranks call this together, in the same order."""


class TorchEngine(Engine):
    """An engine run by PyTorch: the architecture module with this rank's weights on its device."""

    def __init__(self, manifest: Manifest, module: torch.nn.Module, comm: Communicator, load_seconds: float):
        self.manifest = manifest
        self.module = module
        self.comm = comm
        self.load_seconds = load_seconds

    @classmethod
    def load(cls, engine_dir: Path, comm: Communicator) -> "TorchEngine":
        """Read the manifest, check it against the communicator and the device's free memory, and load this
        rank's weights only (safetensors maps the file and copies it straight to the device)."""
        start = time.perf_counter()
        engine_dir = Path(engine_dir)
        manifest = Manifest.read(engine_dir)
        if manifest.plan != comm.plan:
            raise EngineError(f"{engine_dir}: engine was built for {manifest.plan}, but is being loaded on {comm.plan}")
        arch = architecture(manifest.architecture)
        path = manifest.weight_file(engine_dir, comm.rank)
        if comm.device.type == "cuda":
            check_fits(manifest, comm.device.index, torch.cuda.mem_get_info(comm.device)[0], "free")
        with torch.device("meta"):
            module = arch(manifest.config, comm)
        try:
            weights = load_file(path, device=str(comm.device))
        except SafetensorError as error:
            raise EngineError(f"{path}: not a readable safetensors file: {error}") from error
        try:
            module.load_state_dict(weights, strict=True, assign=True)
        except RuntimeError as error:
            raise EngineError(f"{path}: weights do not fit architecture {manifest.architecture!r}: {error}") from error
        module.to(device=comm.device, dtype=TORCH_DTYPES[manifest.data_type]).eval()
        return cls(manifest, module, comm, time.perf_counter() - start)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            on_device = {name: tensor.to(self.comm.device, non_blocking=True) for name, tensor in inputs.items()}
            return self.module(**on_device)
