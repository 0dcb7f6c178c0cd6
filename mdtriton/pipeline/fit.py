"""Will a rank of a pipeline fit its GPU? An estimate of what one rank holds, made before anything is loaded: every
component of the pipeline's directory (text encoders, VAE, diffusers' own transformer) whole, as context and guidance
parallelism leave it on every rank, at the data type it is loaded in (but a part's one-rank components, FLUX.2 [dev]'s
text encoder, counted on the encoding rank only: ranks_components, mdtriton.pipeline.encoder), and our transformer
engines by their own estimate (mdtriton.engine.memory), plus the working memory.

A component's bytes come from its safetensors headers (shapes and data types; no tensor data is read): floating-point
tensors at the data type the pipeline loads them in, other tensors as stored. A component whose folder holds no
safetensors weights (a transformer/ with only its config, which a build with random weights fills) is counted from its
class's parameters and buffers on the meta device.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mdtriton.engine.architecture import Architecture
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.memory import GIB, LARGEST_TP_SIZE, WORKING_MEMORY_BYTES, fitting_tp_size, rank_weight_bytes
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.part import PipelinePart

MODEL_INDEX = "model_index.json"  # a diffusers pipeline directory's list of components
# The weight files diffusers' and transformers' from_pretrained read (without a variant): one file, or the shards its
# index names.
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")
# Bytes per element of each safetensors data type, and which of them from_pretrained casts to the load data type.
STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1,
                "F8_E5M2FNUZ": 1, "C64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
                "U8": 1, "BOOL": 1}
FLOATING = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ")


def components_bytes(pipeline_dir: Path, data_type: str, float32_components: tuple[str, ...],
                     leave_out: tuple[str, ...] = ()) -> dict[str, int]:
    """Bytes each component of the pipeline in pipeline_dir (its model_index.json's, but leave_out's: the transformers
    our engines serve) holds on a rank: loaded in data_type, float32_components in float32. Tokenizers and schedulers
    hold none (and are left out)."""
    pipeline_dir = Path(pipeline_dir)
    sizes = {}
    for name, (library, class_name) in listed_components(pipeline_dir).items():
        if name in leave_out:
            continue
        dtype = torch.float32 if name in float32_components else TORCH_DTYPES[data_type]
        files = weight_files(pipeline_dir / name)
        size = checkpoint_bytes(files, dtype) if files else module_bytes(library, class_name, pipeline_dir / name, dtype)
        if size:
            sizes[name] = size
    return sizes


def listed_components(pipeline_dir: Path) -> dict[str, tuple[str, str]]:
    """The components a diffusers pipeline directory's model_index.json lists, by folder: (library, class name); not
    its own entries ("_class_name", ...) nor a null one (an optional component left out)."""
    index = json.loads((Path(pipeline_dir) / MODEL_INDEX).read_text())
    return {name: tuple(value) for name, value in index.items() if not name.startswith("_") and is_component(value)}


def is_component(value) -> bool:
    """Whether a model_index.json entry is a component with a folder (not null, as an optional one may be)."""
    return isinstance(value, list) and value[0] is not None


def weight_files(component_dir: Path) -> list[Path]:
    """The safetensors files from_pretrained reads for the component in component_dir (none: it holds no weights in
    safetensors)."""
    for name in WEIGHT_FILES:
        index = component_dir / f"{name}.index.json"
        if index.is_file():
            shards = json.loads(index.read_text())["weight_map"].values()
            return [component_dir / shard for shard in sorted(set(shards))]
        if (component_dir / name).is_file():
            return [component_dir / name]
    return []


def checkpoint_bytes(files: list[Path], dtype: torch.dtype) -> int:
    """Bytes of the tensors in files once loaded, by their headers: floating-point ones in dtype, others as stored."""
    total = 0
    for path in files:
        try:
            with safe_open(path, "pt") as handle:
                for name in handle.keys():
                    tensor = handle.get_slice(name)
                    stored = tensor.get_dtype()
                    element = dtype.itemsize if stored in FLOATING else STORED_BYTES[stored]
                    total += math.prod(tensor.get_shape()) * element
        except SafetensorError as error:
            raise EngineError(f"{path}: not a readable safetensors file: {error}") from error
    return total


def module_bytes(library: str, class_name: str, component_dir: Path, dtype: torch.dtype) -> int:
    """Bytes of the parameters and buffers of a component with no weight files (its folder holds its config), its class
    (library's class_name) built on the meta device: floating-point ones in dtype. 0 for what is no module (a
    tokenizer, a scheduler)."""
    module_class = getattr(importlib.import_module(library), class_name, None)
    if not (isinstance(module_class, type) and issubclass(module_class, torch.nn.Module)):
        return 0
    with torch.device("meta"):
        if hasattr(module_class, "from_config"):  # a diffusers model
            module = module_class.from_config(module_class.load_config(component_dir))
        else:  # a transformers model
            module = module_class._from_config(module_class.config_class.from_pretrained(component_dir))
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)


def engines_bytes(engines: dict[str, Manifest], architecture: Architecture | None) -> dict[str, int]:
    """Bytes of the weights of a rank of each of our transformer engines (by folder: `transformer`, Wan 2.2's
    `transformer_2`), as the engine's own fit check counts them."""
    return {folder: rank_weight_bytes(architecture, engine.config, engine.plan, engine.data_type, engine.quantization)
            for folder, engine in engines.items()}


def check_pipeline_fits(components: dict[str, int], engines: dict[str, Manifest], architecture: Architecture | None,
                        data_type: str, gpu: int, memory_bytes: int, memory_kind: str) -> None:
    """Raise EngineError, naming each component's and engine's GiB, the total, the GPU's memory and what to do, unless a
    rank holding components (components_bytes) and a rank of each of our engines (their manifests, of architecture's
    family) fits in memory_bytes of GPU gpu (memory_kind: 'free', 'in all')."""
    needs = {**components, **engines_bytes(engines, architecture)}
    total = sum(needs.values()) + WORKING_MEMORY_BYTES
    if total <= memory_bytes:
        return
    held = ", ".join(f"{name} {size / GIB:.1f} GiB" for name, size in needs.items())
    advice = [f"serve it on GPUs with {total / GIB:.1f} GiB {memory_kind} or more"]
    if data_type == "FP32":
        advice.append("build it with --dtype BF16 (half the bytes of FP32)")
    if engines:
        # Each engine's share of what the components and the working memory leave, plus the working memory its own
        # check adds.
        others = sum(components.values()) + WORKING_MEMORY_BYTES
        each = (memory_bytes - others) // len(engines) + WORKING_MEMORY_BYTES
        tp_size = fitting_tp_size(next(iter(engines.values())), architecture, each)
        advice.append(f"build it with --tp {tp_size} or more (its transformer split over more GPUs)"
                      if tp_size is not None else
                      f"no --tp up to {LARGEST_TP_SIZE} makes its transformer fit beside the other components")
    split = ", its transformer engine split by --tp only" if engines else ""
    raise EngineError(f"a rank of this pipeline holds {held} and {WORKING_MEMORY_BYTES / GIB:.0f} GiB of working "
                      f"memory, {total / GIB:.1f} GiB in all, but GPU {gpu} has {memory_bytes / GIB:.1f} GiB "
                      f"{memory_kind}: context and guidance parallelism split the work, not the weights, so a rank "
                      f"holds each of its components whole{split}; {'; '.join(advice)}")


def ranks_components(components: dict[str, int], part: PipelinePart, plan: ParallelPlan) -> list[dict[str, int]]:
    """What each rank of plan holds of components (components_bytes'), by rank: all of them on the encoding rank, and
    on the others all but those the part loads on that rank only (PipelinePart.one_rank_components)."""
    return [{name: size for name, size in components.items() if name not in part.components_not_on(plan, rank)}
            for rank in range(plan.world_size)]


def check_pipeline_gpus_fit(components: list[dict[str, int]], engines: dict[str, Manifest],
                            architecture: Architecture | None, data_type: str, gpus: list[int]) -> None:
    """At build time, on a host with the GPUs: refuse a pipeline whose rank exceeds its GPU's whole memory
    (check_pipeline_fits), rank r holding components[r] (ranks_components) on gpus[r]: the largest rank is checked on
    its own GPU."""
    if not torch.cuda.is_available():
        return
    for gpu, held in zip(gpus, components):
        if gpu < torch.cuda.device_count():
            check_pipeline_fits(held, engines, architecture, data_type, gpu,
                                torch.cuda.get_device_properties(gpu).total_memory, "in all")
