"""The one benchmark harness: how `mdtriton bench` and the scripts in benchmarks/ take their arguments, load, serve,
time, run and report; each of them keeps only what it measures.

- **One set of model arguments**: `add_model_arguments` (--architecture, --preset, --config, --height, --width,
  --frames, --device), read by `model_config` and `model_sizes` (images or clips in pixels, `Size`, the
  architecture's `DEFAULTS` where not given); bf16 on GPUs, float32 on CPU (`precision`).
- **Load as the server loads**: `bench_engine` makes our engine from weights made in memory through
  TorchEngine.from_weights, what a rank's worker does once it has read its weight file (the module, projections fused,
  then on GPUs the compile and warm-up, and CUDA graphs for short requests), with the manifest the build writes. A
  benchmark times `engine.forward`, the call the job runner makes, so it follows the load path when that changes.
- **Serve as users serve**: `build_pipeline` builds a diffusers pipeline directory with random transformer weights as
  `mdtriton build` does, and `started_server` starts the embedded Triton server on a repository and says how long it
  took to be ready.
- **One timer**: `time_calls` (CUDA events on GPUs, ranks lined up by a barrier first; wall time on CPU), in
  milliseconds, and `timing` for the median and minimum of its times.
- **One way to start ranks**: `run_ranks` starts one process per rank on this host, forked from a fork server that
  has imported torch once (`RANK_PROCESSES`), and `init_rank` begins each (its device, its process group: NCCL on
  GPUs, gloo on CPU).
- **One table format**: `markdown_table` (a Markdown table from a header and rows of cells), titled with
  `device_name`, written with the rows' JSON by `write_results`.
- What every benchmark measures with: random weights (`bench_weights`; FLUX's with trained-like modulation scales),
  the plans of a GPU count (`plans_for`, of the methods in `METHODS`), a FLUX request's inputs (`flux_inputs`), the
  relative error of an output (`relative_error`) and an image's PSNR against another (`psnr`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_shard
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import EngineLimits, Manifest
from mdtriton.engine.plan import CP_METHODS, ParallelPlan
from mdtriton.families import family
from mdtriton.families.family import AttentionShape
from mdtriton.families.flux.transformer import example_inputs
from mdtriton.server import TritonServer, free_port

# Rank processes are forked from multiprocessing's fork server, which imports torch once and never touches CUDA: a rank
# starts in well under a second, where a spawned one imported torch again (seconds each on 2 CPU cores). Nothing that
# asks for the GPUs at import may be preloaded (diffusers does: a forked rank could then not use CUDA). A rank takes its
# parent's environment as it was when the rank was started (rank_environment), not the fork server's.
RANK_PROCESSES = mp.get_context("forkserver")
RANK_PROCESSES.set_forkserver_preload(["torch", "torch.distributed"])
# Trained FLUX models keep their modulation gates small; random N(0, 1/fan_in) modulation weights make them
# O(1), and 57 blocks then amplify any rounding difference (docs/benchmarks.md, "Accuracy").
MODULATION_SCALE = 0.1
# The parallel methods a benchmark measures on several GPUs: each context-parallel method over every GPU (ulysses_ring
# as Ulysses pairs in a ring, 4+ GPUs), tensor parallelism over every GPU, and tp 2 x ulysses (4+ GPUs).
METHODS = (*CP_METHODS, "tp", "tp_cp")


@dataclass(frozen=True)
class Size:
    """An image (1 frame) or a clip, in pixels."""

    frames: int
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}" + (f" x {self.frames}" if self.frames > 1 else "")


@dataclass(frozen=True)
class Defaults:
    """What a run of an architecture measures unless told otherwise: the real model's size, at the sizes users ask
    for (FLUX: 1024x1024 and up; Wan: 480p and 720p clips of 81 frames, 5 s at 16 fps; Cosmos 3: 480p and 720p clips
    of 189 frames, its pipeline's default)."""

    preset: str
    frames: int
    heights: str
    widths: str


DEFAULTS = {"flux": Defaults("flux.1-dev", 1, "1024,2048,4096", "1024,2048,4096"),
            "wan": Defaults("wan2.1-t2v-14b", 81, "480,720", "832,1280"),
            "cosmos3": Defaults("cosmos3-15b", 189, "480,720", "832,1280")}


def add_model_arguments(parser: argparse.ArgumentParser, architectures: list[str]) -> None:
    """What `mdtriton bench` and the scripts that measure a family's transformer take: --architecture (the first of
    architectures by default), --preset, --config, the sizes in pixels (--height, --width, --frames: model_sizes) and
    --device."""
    def each(field: str) -> str:
        return "; ".join(f"{name} {getattr(DEFAULTS[name], field)}" for name in architectures if name in DEFAULTS)

    parser.add_argument("--architecture", default=architectures[0], choices=architectures,
                        help=f"the model family ({', '.join(architectures)}; default {architectures[0]})")
    parser.add_argument("--preset", help=f"its size (default: {each('preset')}; the presets are those of mdtriton "
                                         "build --preset)")
    parser.add_argument("--config", default="{}", help="JSON overriding the preset's config")
    parser.add_argument("--height", help=f"image or clip heights in pixels, one per size (default: {each('heights')})")
    parser.add_argument("--width", help=f"widths, one per height (default: {each('widths')})")
    parser.add_argument("--frames", type=int, help=f"frames of every size (default: {each('frames')})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (default when there is a GPU) or cpu: float32 (gloo ranks), for checking the tool "
                             "with --preset tiny")


def model_config(args: argparse.Namespace) -> dict:
    """The config of --architecture at --preset with --config's changes; a missing --preset becomes the
    architecture's default (DEFAULTS, else its first preset)."""
    presets = family(args.architecture).presets()
    if args.preset is None:
        args.preset = DEFAULTS[args.architecture].preset if args.architecture in DEFAULTS else next(iter(presets))
    if args.preset not in presets:
        raise ValueError(f"{args.architecture} has no preset {args.preset!r}; choose from {', '.join(presets)}")
    return {**presets[args.preset], **json.loads(args.config)}


def model_sizes(args: argparse.Namespace, config: dict) -> list[Size]:
    """The sizes of --height, --width and --frames, or the architecture's defaults; a size the family's pipeline
    refuses is refused here, before anything runs."""
    defaults = DEFAULTS.get(args.architecture)
    if defaults is None and None in (args.height, args.width, args.frames):
        raise ValueError(f"--architecture {args.architecture} has no default sizes; give --height, --width and "
                         "--frames")
    if (args.height is None) != (args.width is None):
        raise ValueError("give --height and --width together (one width per height)")
    heights = [int(n) for n in (args.height or defaults.heights).split(",")]
    widths = [int(n) for n in (args.width or defaults.widths).split(",")]
    if len(heights) != len(widths):
        raise ValueError(f"{len(heights)} heights and {len(widths)} widths; give one width per height")
    frames = defaults.frames if args.frames is None else args.frames
    sizes = [Size(frames, height, width) for height, width in zip(heights, widths)]
    for size in sizes:
        family(args.architecture).media_request(config, size.frames, size.height, size.width, torch.float32)
    return sizes


def precision(device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype and data type a benchmark runs in on the device: bf16 on GPUs (as served), float32 on CPU."""
    return (torch.bfloat16, "BF16") if device.type == "cuda" else (torch.float32, "FP32")


def device_name(device: torch.device) -> str:
    """The device for a table's title: the GPU's name, or CPU; and torch's version."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"{name}, torch {torch.__version__}"


def bench_engine(architecture: str, config: dict, comm: Communicator, weights: dict[str, torch.Tensor],
                 data_type: str, quantization: str | None = None, compiled: bool | None = None) -> TorchEngine:
    """This rank's engine of the architecture from its weights (on its device), loaded as the server loads it:
    TorchEngine.from_weights with the manifest the build writes for it. The engine takes the tensors and empties
    `weights` (pass a copy of a dict that other models share). compiled: None compiles on GPUs only, as the server
    does; True or False say so for a variant."""
    model_family = family(architecture)
    inputs, outputs = model_family.signature(config, data_type)
    manifest = Manifest(model_family.name, config, comm.plan, data_type, inputs, outputs, quantization=quantization)
    return TorchEngine.from_weights(manifest, model_family, comm, weights, compile=compiled)


def is_modulation(name: str) -> bool:
    """Whether a FLUX weight is a modulation (adaptive norm) linear's, whose outputs are shifts, scales and gates."""
    return ".linear." in name and ("norm1" in name or ".norm." in name or name.startswith("norm_out."))


def bench_weights(architecture: str, config: dict, plan: ParallelPlan, rank: int, device: torch.device,
                  dtype: torch.dtype, quantization: str | None) -> dict[str, torch.Tensor]:
    """Rank's random weights (seed 0: the same full model for every plan); FLUX's with trained-like modulation
    scales."""
    weights = random_shard(architecture, config, plan, rank, seed=0, device=device, dtype=dtype,
                           quantization=quantization)
    if architecture != "flux":
        return weights
    return {name: t * MODULATION_SCALE if is_modulation(name) else t for name, t in weights.items()}


def flux_inputs(config: dict, text_tokens: int, image_tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One request's inputs, identical on every rank (seeded on the CPU): image ids on a square-ish grid; bf16 on
    GPUs, float32 on CPU."""
    dtype, _ = precision(device)
    return {name: t.to(device) for name, t in example_inputs(config, text_tokens, image_tokens, dtype).items()}


def plans_for(world_size: int, methods: list[str]) -> dict[str, ParallelPlan]:
    """The plans to measure on world_size GPUs (1 GPU: the single plan)."""
    if world_size == 1:
        return {"1 GPU": ParallelPlan()}
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    plans = {}
    for method in methods:
        if method == "tp":
            plans[method] = ParallelPlan(tp_size=world_size)
        elif method == "tp_cp":
            if world_size >= 4 and world_size % 2 == 0:
                plans[method] = ParallelPlan(tp_size=2, cp_size=world_size // 2, cp_method="ulysses")
        elif method == "ulysses_ring":
            if world_size >= 4 and world_size % 2 == 0:  # Ulysses in pairs of GPUs, a ring across the pairs
                plans[method] = ParallelPlan(cp_size=world_size, cp_method=method, ulysses_size=2)
        else:
            plans[method] = ParallelPlan(cp_size=world_size, cp_method=method)
    return plans


def attention_flops(tokens: int, shape: AttentionShape) -> float:
    """FLOPs of one layer's attention over tokens: 4 S^2 heads head_dim (shape: Family.attention_shape)."""
    return 4 * tokens**2 * shape.heads * shape.head_dim


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - b|| / ||b||: bf16 rounds each element to 2-3 digits, so the norm, not single elements, measures a plan."""
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def psnr(image: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio of a uint8 image against another, in dB (infinite for equal images)."""
    mse = float(np.mean((image.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def time_calls(call, cuda: bool, warmup: int, iterations: int) -> tuple[list[float], object]:
    """Milliseconds of each timed call (CUDA events on GPU; ranks lined up by a barrier first), and the last result."""
    times = []
    for i in range(warmup + iterations):
        if dist.is_initialized():
            dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            began = time.perf_counter()
        result = call()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - began) * 1000
        if i >= warmup:
            times.append(elapsed)
    return times, result


def timing(times: list[float]) -> dict[str, float]:
    """The median and the minimum of time_calls' milliseconds, as every table reports them."""
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def init_rank(rank: int, world_size: int, port: int, cuda: bool, group_of_one: bool = False,
              bind_device: bool = True, timeout_s: float | None = None) -> torch.device:
    """Begin a rank process of run_ranks: its device (GPU `rank`, made current, or the CPU) and, for more than one
    rank, the default process group (NCCL on GPUs, gloo on CPU) at 127.0.0.1:port. group_of_one: a group for one rank
    too (xfuser needs one); bind_device: bind NCCL to the device at init (xfuser's new_group() calls fail when it is);
    timeout_s: the group's collective timeout (torch's default if None)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 or group_of_one:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size,
                                device_id=device if cuda and bind_device else None,
                                timeout=timedelta(seconds=timeout_s) if timeout_s else None)
    return device


def rank_environment(rank: int, environment: dict[str, str], entry, *args) -> None:
    """entry(rank, *args) in a rank process whose environment is `environment` (its parent's as the rank started)."""
    os.environ.clear()
    os.environ.update(environment)
    entry(rank, *args)


def run_ranks(entry, world_size: int, args: tuple, time_limit: float = 0) -> str | None:
    """Run entry(rank, world_size, port, *args) in world_size new processes (RANK_PROCESSES), which begin with
    init_rank(rank, world_size, port, ...); stop them all after time_limit seconds (0: no limit). Returns what went
    wrong, or None."""
    context = mp.start_processes(rank_environment, args=(dict(os.environ), entry, world_size, free_port(), *args),
                                 nprocs=world_size, join=False, start_method=RANK_PROCESSES.get_start_method())
    deadline = time.monotonic() + time_limit if time_limit else None
    try:
        while not context.join(timeout=5):
            if deadline and time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                return f"{world_size} rank(s): stopped after the time limit of {time_limit:g} s"
    except Exception as error:  # noqa: BLE001 - a rank died: join has ended the others
        print(error, file=sys.stderr, flush=True)  # the rank's traceback
        return f"{world_size} rank(s): a rank failed: {str(error).strip().splitlines()[-1]}"
    return None


# Kernel kinds, by marks in a kernel's name (the first kind whose mark it contains; "other" where none does).
KERNEL_KINDS = (("NCCL", ("nccl",)), ("attention", ("attention", "fmha", "flash", "cudnn")),
                ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "gemv", "aten::mm", "addmm")),
                ("fused (Triton)", ("triton_",)), ("copy", ("copy", "cat", "pad", "memcpy", "elementwise")))
KERNEL_KIND_NAMES = (*(kind for kind, _ in KERNEL_KINDS), "other")


def kind_of(kernel: str) -> str:
    """The kind of the kernel of that name (KERNEL_KINDS)."""
    name = kernel.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(mark in name for mark in marks)), "other")


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table: the header's cells, then each row's cells (already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def build_pipeline(repository: Path, model: str, architecture: str, pipeline_dir: Path, data_type: str,
                   device: torch.device, plan: ParallelPlan = ParallelPlan(), **options) -> Path:
    """The model version `mdtriton build --architecture ARCHITECTURE --weights PIPELINE_DIR` makes of a diffusers
    pipeline directory whose transformer/ holds only its config: the transformer's random weights made on the device
    (seed 0, so every plan and data type computes the same model), any request size allowed. options: further
    BuildRequest fields, as their `mdtriton build` options would give them (e.g. the elastic layout's in
    benchmarks/load.py). Returns the version's directory."""
    return build_model_version(repository, model, BuildRequest(
        architecture, None, plan, data_type, "gpu" if device.type == "cuda" else "cpu", weights_path=pipeline_dir,
        limits=EngineLimits(max_tokens=1 << 20), random_transformer=True, random_device=device.type, progress=False,
        **options))


@contextmanager
def started_server(repository: Path, log_file: Path,
                   models: tuple[str, ...] = ()) -> Iterator[tuple[TritonServer, float]]:
    """The embedded Triton server on the repository (loading only `models` where given, else every model) and the
    seconds from its start until it was ready; stopped on leaving."""
    began = time.perf_counter()
    with TritonServer(repository, model_control_mode="explicit" if models else "none", load_models=models,
                      log_file=log_file) as server:
        yield server, time.perf_counter() - began


def write_results(output_dir: Path, text: str, data: dict) -> None:
    """A run's tables (results.md, as printed) and its rows (results.json) in output_dir."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.md").write_text(text)
    (output_dir / "results.json").write_text(json.dumps(data, indent=1))
