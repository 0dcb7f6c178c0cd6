"""Will an engine fit its GPUs? An estimate from the manifest (config, plan, data type) and its family's module,
made before anything is allocated, with the tensor-parallel size that would fit when it does not."""

from __future__ import annotations

from dataclasses import replace

import torch

from mdtriton.engine.architecture import Architecture
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.fp8 import FP8_DTYPE
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.modules import meta_module, stored_dtype
from mdtriton.engine.plan import ParallelPlan

GIB = 1 << 30
# Beside its weights a rank needs activations, kernel workspaces, NCCL buffers and the CUDA context.
WORKING_MEMORY_BYTES = 4 * GIB
LARGEST_TP_SIZE = 64


def rank_weight_bytes(architecture: Architecture, config: dict, plan: ParallelPlan, data_type: str,
                      quantization: str | None = None) -> int:
    """Bytes of the weights each rank of plan holds (replicated weights in full, split ones in part); with
    quantization, the quantized weights and their scales at their own sizes, the rest in data_type (or float32 where
    the family keeps them so)."""
    dtype = TORCH_DTYPES[data_type]
    module = meta_module(architecture, config, plan, 0, quantization)
    total = 0
    for name, tensor in module.state_dict().items():
        kept = tensor.dtype == FP8_DTYPE or name.endswith(".weight_scale")
        stored = tensor.element_size() if kept else stored_dtype(module, name, dtype).itemsize
        total += stored * tensor.numel()
    return total


def fitting_tp_size(manifest: Manifest, architecture: Architecture, memory_bytes: int) -> int | None:
    """The smallest tensor-parallel size (same context parallelism) whose ranks fit in memory_bytes, if any."""
    for tp_size in range(1, LARGEST_TP_SIZE + 1):
        plan = replace(manifest.plan, tp_size=tp_size)
        try:
            architecture.check_plan(manifest.config, plan)
        except ValueError:
            continue
        weights = rank_weight_bytes(architecture, manifest.config, plan, manifest.data_type,
                                    manifest.quantization)
        if weights + WORKING_MEMORY_BYTES <= memory_bytes:
            return tp_size
    return None


def check_fits(manifest: Manifest, architecture: Architecture, gpu: int, memory_bytes: int, memory_kind: str) -> None:
    """Raise EngineError, naming the memory needed and the tensor-parallel size that would fit, unless a rank of
    manifest (an engine of architecture) fits in memory_bytes of GPU gpu (memory_kind says which memory that is:
    'free', 'in all')."""
    weights = rank_weight_bytes(architecture, manifest.config, manifest.plan, manifest.data_type,
                                manifest.quantization)
    if weights + WORKING_MEMORY_BYTES <= memory_bytes:
        return
    tp_size = fitting_tp_size(manifest, architecture, memory_bytes)
    if tp_size is None:
        advice = f"no tensor-parallel size up to {LARGEST_TP_SIZE} fits"
    else:
        plan = replace(manifest.plan, tp_size=tp_size)
        per_gpu = rank_weight_bytes(architecture, manifest.config, plan, manifest.data_type,
                                    manifest.quantization)
        advice = f"build it with --tp {tp_size} ({per_gpu / GIB:.1f} GiB of weights per GPU) or more"
    raise EngineError(f"the engine ({manifest.architecture}, {manifest.plan}, {manifest.weight_type}) needs "
                      f"{weights / GIB:.1f} GiB of weights per GPU plus {WORKING_MEMORY_BYTES / GIB:.0f} GiB of "
                      f"working memory, but GPU {gpu} has {memory_bytes / GIB:.1f} GiB {memory_kind}; {advice}")


def check_gpus_fit(manifest: Manifest, architecture: Architecture, gpus: list[int]) -> None:
    """At build time, on a host with the GPUs: refuse an engine whose ranks exceed a GPU's whole memory."""
    if not torch.cuda.is_available():
        return
    for gpu in gpus:
        if gpu < torch.cuda.device_count():
            check_fits(manifest, architecture, gpu, torch.cuda.get_device_properties(gpu).total_memory, "in all")
