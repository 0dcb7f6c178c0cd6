"""`mdtriton bench`: one transformer forward of a model family (FLUX, Wan, Cosmos 3) per GPU count x parallel method x
variant x image or clip size.

Built on the benchmark harness (mdtriton/harness.py), as the scripts in benchmarks/ are. Each GPU count runs in its
own set of processes (one per GPU, NCCL). Sizes are images or clips in pixels (--height, --width, --frames), made
into the request the family's pipeline sends its transformer (Family.media_request): FLUX at 1024x1024 is 4,096
image + 512 text tokens, 2048x2048 16,384 + 512; Wan at 832x480 x 81 frames 32,760 tokens, 1280x720 x 81 75,600;
Cosmos 3 at 832x480 x 189 frames 18,720 video + 256 text tokens, 1280x720 x 189 44,160 + 256 (its text pathway
runs at every call, as diffusers' model runs it; the pipeline runs it once per request: docs/benchmarks.md).
Weights are random, made on each GPU shard by shard from one seed (the same full model for every plan), bf16
(FLUX's with trained-like scales: modulation weights x 0.1, so the gates stay small: see docs/benchmarks.md,
"Accuracy"). The engine is loaded as the server loads it (TorchEngine.from_weights) and timed through its forward.
Variants: `compiled` (what the server runs: on GPUs fused projections, compiled blocks, warmed up at load, short
requests replayed as CUDA graphs; on CPU, as the server there, not compiled), `eager` (the same module uncompiled,
no graphs), `fp8` (FP8 weights, as compiled). Timing: the first call at each size after the warm-up (a recompile
would show here), then warm-up runs, then CUDA-event times of whole forwards between barriers; the median is
reported, with the peak GPU memory allocated at that size. One more forward runs under the PyTorch profiler (GPUs):
the share of kernel time in NCCL kernels (which overlap compute, and count their waits for a peer); on each rank the
time in which NCCL kernels ran alone (communication that no compute hid, waits for a slower rank included), the time
in which no kernel ran (kernel_timeline) and the time in kernels other than NCCL's (where the forward runs eagerly,
over 8,192 tokens, the profiler's own cost on the CPU can leave one rank launch-bound, and the first two columns then
overstate what the timed forwards wait); and a table of rank 0's kernel time
by kind (GEMMs, attention, copies, ...) against an even share of the 1-GPU forward's: what a rank does beyond its share
of one GPU's work (--traces DIR keeps each rank's profile as a Chrome trace). At the first size every output is
compared with the 1-GPU compiled output and with a float32 forward of the same weights, made first on its own (unless
--no-check). A last table times one block's attention alone (the method's communication included) against cuDNN's
attention on one GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from mdtriton.engine.attention import attention_for
from mdtriton.engine.attention.local import cudnn_sdpa
from mdtriton.engine.comm import Communicator
from mdtriton.engine.fp8 import Fp8Unsupported, check_fp8_device
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import Family, families, family
from mdtriton.families.family import AttentionShape
from mdtriton.harness import (KERNEL_KIND_NAMES, METHODS, add_model_arguments, attention_flops, bench_engine,
                              bench_weights, init_rank, kind_of, markdown_table, model_config, model_sizes, plans_for,
                              precision, relative_error, run_ranks, time_calls, timing, write_results)

VARIANTS = ("compiled", "eager", "fp8")
# The profiler's name for the call communication_timeline measures.
PROFILED_CALL = "mdtriton.bench.profiled_call"


def benchmarked_architectures() -> list[str]:
    """The families `mdtriton bench` can measure: those that make a request from a size (Family.media_request)."""
    return [name for name, item in families().items() if type(item).media_request is not Family.media_request]


def communication_timeline(call, trace: Path | None = None) -> dict:
    """One call's GPU kernels under the profiler on every rank (profiled_kernels), summed by kernels_summary."""
    return kernels_summary(profiled_kernels(call, trace))


def profiled_kernels(call, trace: Path | None = None) -> list[tuple[str, float, float]]:
    """This rank's GPU kernels of one call under the profiler, on every rank (a collective of the default group, where
    there is one): each kernel's name, start and end in microseconds. trace: where to write this rank's profile as a
    gzipped Chrome trace (chrome://tracing, Perfetto), if given.

    The ranks start their profilers at different times (tens of milliseconds apart); a barrier after the start lines
    them up again, and only the kernels that start after it count (a first collective would otherwise wait out that
    difference: 59 ms "alone" on one rank of a 45 ms forward)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        torch.cuda.synchronize()
        with record_function(PROFILED_CALL):
            call()
            torch.cuda.synchronize()
    if trace is not None:
        profiler.export_chrome_trace(str(trace))  # gzipped: the name ends in .gz
    events = profiler.events()
    begin = min(event.time_range.start for event in events if event.name == PROFILED_CALL)
    return [(event.name, event.time_range.start, event.time_range.end) for event in events
            if event.device_type == DeviceType.CUDA and event.time_range.start >= begin
            and event.name != PROFILED_CALL]  # the region's own span on the GPU's timeline


def kernels_summary(kernels: list[tuple[str, float, float]]) -> dict:
    """From every rank's profiled_kernels (a collective of the default group, where there is one), as kernel_timeline
    sums them: this rank's NCCL share, every rank's exposed, idle and compute (kernels other than NCCL's)
    milliseconds in rank order (where one rank computes longer than the others, theirs wait for it in NCCL kernels),
    and this rank's kernel milliseconds by kind (harness.kind_of; kernels that overlap each count whole)."""
    mine = kernel_timeline([(start, end, "nccl" in name.lower()) for name, start, end in kernels])
    by_kind = dict.fromkeys(KERNEL_KIND_NAMES, 0.0)
    for name, start, end in kernels:
        by_kind[kind_of(name)] += (end - start) / 1000
    mine["compute_ms"] = sum(ms for kind, ms in by_kind.items() if kind != "NCCL")
    every_rank = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, mine)
    return {"communication_share": mine["communication_share"],
            "exposed_ms": [rank["exposed_ms"] for rank in every_rank],
            "idle_ms": [rank["idle_ms"] for rank in every_rank],
            "compute_ms": [rank["compute_ms"] for rank in every_rank], "kernel_ms_by_kind": by_kind}


def kernel_timeline(kernels: list[tuple[float, float, bool]]) -> dict[str, float]:
    """From each kernel's (start, end, whether it is NCCL's), in microseconds: `communication_share`, the share of
    kernel time in NCCL kernels (which may overlap compute, and count the time they wait for a peer);
    `exposed_ms`, the time in which NCCL kernels ran and nothing else did (communication that no compute hid, waits
    for a peer included); `idle_ms`, the time between the first kernel's start and the last one's end in which no
    kernel ran."""
    if not kernels:
        return {"communication_share": 0.0, "exposed_ms": 0.0, "idle_ms": 0.0}
    busy = sum(end - start for start, end, _ in kernels)
    nccl = sum(end - start for start, end, is_nccl in kernels if is_nccl)
    anything = covered([(start, end) for start, end, _ in kernels])
    compute = covered([(start, end) for start, end, is_nccl in kernels if not is_nccl])
    span = max(end for _, end, _ in kernels) - min(start for start, _, _ in kernels)
    return {"communication_share": nccl / busy if busy else 0.0, "exposed_ms": (anything - compute) / 1000,
            "idle_ms": (span - anything) / 1000}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals, as disjoint intervals in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    return sum(end - start for start, end in union(intervals))


def attention_inputs(shape: AttentionShape, plan: ParallelPlan, tokens: int,
                     device: torch.device) -> tuple[torch.Tensor, ...]:
    """One layer's q [1, heads per TP rank, tokens per CP rank, head_dim] for a sequence of tokens, and k and v with
    the key/value heads per TP rank (one where they do not divide by tp_size, as Cosmos 3's engine holds them)."""
    generator = torch.Generator(device).manual_seed(1)
    local_len = -(-tokens // plan.cp_size)
    kv_heads = shape.kv_heads // plan.tp_size if shape.kv_heads % plan.tp_size == 0 else 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return tuple(torch.randn((1, heads, local_len, shape.head_dim), generator=generator, device=device, dtype=dtype)
                 for heads in (shape.heads // plan.tp_size, kv_heads, kv_heads))


def sample_file(world_size: int, method: str, variant: str) -> str:
    return f"sample-{world_size}-{method}-{variant}.safetensors"


def save_sample(sample: torch.Tensor, path: Path) -> None:
    save_file({"sample": sample.cpu().contiguous()}, path)


def load_sample(path: Path) -> torch.Tensor:
    return load_file(path)["sample"]


def free_memory(device: torch.device) -> None:
    """Give what dropped engines held back to the GPU before the next model is made."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def float32_sample(args: argparse.Namespace, config: dict, request: dict[str, torch.Tensor], device: torch.device,
                   work_dir: str) -> None:
    """The 1-GPU model with the same bf16 weights but float32 activations, at the first size: the bf16 engine's own
    rounding error shows against it, one GPU's included. Made first, alone on the GPU (FLUX.1-dev's float32 copy is
    48 GB, Wan 14B's 57 GB), each weight converted as the bf16 one is dropped."""
    weights = bench_weights(args.architecture, config, ParallelPlan(), 0, device, torch.bfloat16, None)
    weights = {name: weights.pop(name).float() for name in list(weights)}
    engine = bench_engine(args.architecture, config, Communicator.single(device), weights, "FP32", compiled=False)
    sample = engine.forward({name: tensor.float() if tensor.is_floating_point() else tensor  # token ids stay ids
                             for name, tensor in request.items()})["sample"]
    save_sample(sample, Path(work_dir) / sample_file(1, "1 GPU", "float32"))


def add_errors(rows: list[dict], first_size: str, work_dir: str, baseline: str) -> None:
    """Each row's relative error (norm) at the first size against the 1-GPU output of the baseline variant and the
    float32 output."""
    for row in rows:
        path = Path(work_dir) / sample_file(row["gpus"], row["method"], row["variant"])
        if row["size"] != first_size or not path.exists():
            continue
        sample = load_sample(path)
        for reference, key in ((baseline, "error_vs_1gpu"), ("float32", "error_vs_float32")):
            reference_path = Path(work_dir) / sample_file(1, "1 GPU", reference)
            if reference_path.exists():
                row[key] = relative_error(sample, load_sample(reference_path))


def bench_plans(args: argparse.Namespace, world_size: int, config: dict) -> dict[str, ParallelPlan]:
    """The plans of --methods on world_size GPUs that the family can split (those it cannot are said and skipped)."""
    plans = {}
    for method, plan in plans_for(world_size, args.methods).items():
        try:
            family(args.architecture).check_plan(config, plan)
        except ValueError as error:
            print(f"skipped {method} on {world_size} GPUs: {error}", flush=True)
            continue
        plans[method] = plan
    return plans


def forward_row(call, args: argparse.Namespace, device: torch.device,
                trace: Path | None = None) -> tuple[dict, torch.Tensor]:
    """One forward, call(), timed as the bench times every forward (ours and the peers' in benchmarks/): its first
    call apart (a compile or a recompile shows there), the median of --iterations after --warmup, one more under the
    profiler on GPUs (communication_timeline, trace: where to keep it), the peak memory allocated; the row's timings
    and the last output."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    first, _ = time_calls(call, cuda, 0, 1)
    times, output = time_calls(call, cuda, args.warmup, args.iterations)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    kernels = (communication_timeline(call, trace) if cuda else
               {"communication_share": 0.0, "exposed_ms": [], "idle_ms": [], "compute_ms": [], "kernel_ms_by_kind": {}})
    return {**timing(times), "first_ms": first[0], **kernels, "peak_gib": peak}, output


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, work_dir: str) -> None:
    cuda = args.device == "cuda"
    device = init_rank(rank, world_size, port, cuda)
    model_family = family(args.architecture)
    config = model_config(args)
    dtype, data_type = precision(device)
    requests = {str(size): {name: tensor.to(device) for name, tensor in
                            model_family.media_request(config, size.frames, size.height, size.width, dtype).items()}
                for size in args.sizes}
    tokens = {label: model_family.request_size(config, request).tokens for label, request in requests.items()}
    first_size = str(args.sizes[0])
    if world_size == 1 and args.check:
        float32_sample(args, config, requests[first_size], device, work_dir)
        free_memory(device)
    rows, attention_rows = [], []
    for method, plan in bench_plans(args, world_size, config).items():
        comm = Communicator(plan, rank, device)
        comm.join_groups()
        for variant in args.variants:
            quantization = "fp8" if variant == "fp8" else None
            weights = bench_weights(args.architecture, config, plan, rank, device, dtype, quantization)
            engine = bench_engine(args.architecture, config, comm, weights, data_type, quantization,
                                  compiled=False if variant == "eager" else None)
            for label, request in requests.items():
                name = re.sub(r"[^A-Za-z0-9]+", "-", f"{world_size}gpu-{method}-{variant}-{label}-rank{rank}")
                trace = args.traces / f"{name}.json.gz" if args.traces else None
                row, output = forward_row(lambda: engine.forward(request)["sample"], args, device, trace)
                row = {"gpus": world_size, "method": method, "variant": variant, "plan": str(plan), "size": label,
                       "tokens": tokens[label], "warm_up_s": engine.warm_up_seconds, **row}
                if label == first_size and args.check and rank == 0:
                    save_sample(output, Path(work_dir) / sample_file(world_size, method, variant))
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
            engine = output = None  # free this variant's weights before the next ones are made
            free_memory(device)
        for label in requests:
            q, k, v = attention_inputs(model_family.attention_shape(config), plan, tokens[label], device)
            attention = attention_for(plan)
            with torch.inference_mode():
                times, _ = time_calls(lambda: attention(q, k, v, comm, tokens[label]), cuda, args.warmup,
                                      5 * args.iterations)
            attention_rows.append({"gpus": world_size, "method": method, "size": label, "tokens": tokens[label],
                                   "median_ms": timing(times)["median_ms"]})
    if world_size == 1:
        # cuDNN's attention alone over the whole sequence: the rate the engine's attention is held against.
        for label in requests:
            q, k, v = attention_inputs(model_family.attention_shape(config), ParallelPlan(), tokens[label], device)
            with torch.inference_mode():
                times, _ = time_calls(lambda: cudnn_sdpa(q, k, v), cuda, args.warmup, 5 * args.iterations)
            attention_rows.append({"gpus": 1, "method": "cuDNN SDPA", "size": label, "tokens": tokens[label],
                                   "median_ms": timing(times)["median_ms"]})
    if rank == 0:
        with open(Path(work_dir) / f"rows-{world_size}.json", "w") as handle:
            json.dump({"forward": rows, "attention": attention_rows}, handle)
    if dist.is_initialized():
        dist.destroy_process_group()


def size_cell(row: dict) -> str:
    return f"{row['size']} ({row['tokens']:,} tokens)"


def forward_table(rows: list[dict], shape: AttentionShape, baseline: str) -> str:
    """Speed-ups are over the 1-GPU forward of the baseline variant (compiled: our fastest bf16 base, where
    measured)."""
    single = {r["size"]: r["median_ms"] for r in rows if r["method"] == "1 GPU" and r["variant"] == baseline}
    header = ["size", "GPUs", "method", "variant", "plan", "median ms", "first call ms", "warm-up s", "speedup",
              "efficiency", "attention-equivalent TFLOP/s per GPU", "NCCL share of GPU time",
              "NCCL alone ms, by rank", "GPU idle ms, by rank", "compute kernels ms, by rank", "peak GiB",
              f"rel. error vs 1 GPU {baseline} / vs float32"]
    cells = []
    for r in sorted(rows, key=lambda r: (r["tokens"], r["gpus"], r["method"], r["variant"])):
        speedup = single.get(r["size"], float("nan")) / r["median_ms"]
        tflops = attention_flops(r["tokens"], shape) * shape.layers / r["gpus"] / r["median_ms"] / 1e9
        error = " / ".join(f"{r[key]:.1e}" if key in r else "-" for key in ("error_vs_1gpu", "error_vs_float32"))
        cells.append([size_cell(r), r["gpus"], r["method"], r["variant"], r["plan"], f"{r['median_ms']:.1f}",
                      f"{r['first_ms']:.1f}", f"{r['warm_up_s']:.0f}", f"{speedup:.2f}x",
                      f"{100 * speedup / r['gpus']:.0f}%", f"{tflops:.0f}", f"{100 * r['communication_share']:.0f}%",
                      by_rank(r["exposed_ms"]), by_rank(r["idle_ms"]), by_rank(r["compute_ms"]), f"{r['peak_gib']:.1f}",
                      "" if error == "- / -" else error])
    return markdown_table(header, cells)


def kinds_table(rows: list[dict]) -> str:
    """Rank 0's kernel milliseconds by kind in its profiled forward (GPUs only), each with its multiple of an even
    share of the 1-GPU forward's (1-GPU ms / GPUs): where a rank's work exceeds its share of one GPU's. Empty on CPU."""
    profiled = [r for r in rows if r["kernel_ms_by_kind"]]
    if not profiled:
        return ""
    single = {(r["size"], r["variant"]): r["kernel_ms_by_kind"] for r in profiled if r["method"] == "1 GPU"}
    cells = []
    for r in sorted(profiled, key=lambda r: (r["tokens"], r["gpus"], r["method"], r["variant"])):
        mine, base = dict(r["kernel_ms_by_kind"]), dict(single.get((r["size"], r["variant"]), {}))
        for by_kind in (mine, base):
            by_kind["all but NCCL"] = sum(ms for kind, ms in by_kind.items() if kind != "NCCL")
        cells.append([size_cell(r), r["gpus"], r["method"], r["variant"]]
                     + [f"{mine[kind]:.1f}" + (f" ({mine[kind] * r['gpus'] / base[kind]:.2f}x)"
                                               if r["gpus"] > 1 and base.get(kind) else "")
                        for kind in [*KERNEL_KIND_NAMES, "all but NCCL"]])
    return ("Kernel ms by kind in one profiled forward (rank 0; kernels that overlap each count whole; in brackets, "
            "against an even share of the 1-GPU forward's):\n\n"
            + markdown_table(["size", "GPUs", "method", "variant", *KERNEL_KIND_NAMES, "all but NCCL"], cells)
            + "\n\n")


def by_rank(milliseconds: list[float]) -> str:
    return " / ".join(f"{value:.1f}" for value in milliseconds) or "-"


def attention_table(rows: list[dict], shape: AttentionShape) -> str:
    """One block's attention alone by size, GPU count and method, its rate against one GPU's cuDNN attention."""
    cudnn = {r["size"]: r["median_ms"] for r in rows if r["method"] == "cuDNN SDPA"}
    header = ["size", "GPUs", "method", "median ms (one block)", "TFLOP/s per GPU", "% of 1-GPU cuDNN rate"]
    cells = []
    for r in sorted(rows, key=lambda r: (r["tokens"], r["gpus"], r["method"])):
        tflops = attention_flops(r["tokens"], shape) / r["gpus"] / r["median_ms"] / 1e9
        base = attention_flops(r["tokens"], shape) / cudnn[r["size"]] / 1e9
        cells.append([size_cell(r), r["gpus"], r["method"], f"{r['median_ms']:.2f}", f"{tflops:.0f}",
                      f"{100 * tflops / base:.0f}%"])
    return markdown_table(header, cells)


def plot(rows: list[dict], path: Path, baseline: str) -> None:
    """Each method's speed-up over one GPU by GPU count, per size, for the baseline variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({(r["tokens"], size_cell(r), r["size"]) for r in rows})
    figure, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    measured = [r for r in rows if r["variant"] == baseline]
    for axis, (_, title, size) in zip(axes[0], sizes):
        single = next((r["median_ms"] for r in measured if r["method"] == "1 GPU" and r["size"] == size), None)
        for method in sorted({r["method"] for r in measured if r["gpus"] > 1}):
            points = sorted((r["gpus"], single / r["median_ms"]) for r in measured
                            if r["method"] == method and r["size"] == size and single)
            axis.plot([1] + [p[0] for p in points], [1.0] + [p[1] for p in points], marker="o", label=method)
        gpus = sorted({r["gpus"] for r in rows})
        axis.plot(gpus, gpus, linestyle="--", color="gray", label="ideal")
        axis.set(title=title, xlabel="GPUs", ylabel="speedup over 1 GPU")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def add_parser(subparsers) -> None:
    architectures = benchmarked_architectures()
    parser = subparsers.add_parser("bench", help="measure a transformer engine on 1..N GPUs per parallel method",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, architectures)
    parser.set_defaults(run=run)


def add_arguments(parser: argparse.ArgumentParser, architectures: list[str]) -> None:
    """`mdtriton bench`'s arguments, which the forward peers (benchmarks/forward_peers.py) take for our rows too."""
    add_model_arguments(parser, architectures)
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts to measure (default 1,2,4; 1 is the baseline)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"methods (default {','.join(METHODS)})")
    parser.add_argument("--variants",
                        help="compiled (as served), eager, fp8 (FP8 weights, compiled; GPUs of compute capability "
                             "8.9+); speed-ups and errors are against the 1-GPU compiled forward, or the first "
                             "variant's without compiled (default compiled,eager,fp8; fp8 left out, saying so, where "
                             "the GPUs have no FP8, and on CPU)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="do not compare the outputs at the first size with the 1-GPU output and a float32 "
                             "forward (whose model must fit one GPU in float32: 48 GB for FLUX.1-dev, 57 GB for "
                             "Wan 14B)")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--traces", type=Path, metavar="DIR",
                        help="write each rank's profiled forward (GPUs) to DIR as a gzipped Chrome trace, one file per "
                             "GPU count, method, variant, size and rank")


def prepare(args: argparse.Namespace) -> None:
    """Check the arguments before any rank starts, saying what to give instead, and turn them into lists: --gpus
    into args.counts, --methods and --variants into lists (args.baseline: the variant speed-ups are against), the
    sizes into args.sizes."""
    args.counts = sorted({int(g) for g in args.gpus.split(",")} | {1})
    if args.device == "cuda" and max(args.counts) > torch.cuda.device_count():
        raise ValueError(f"asked for {max(args.counts)} GPUs, {torch.cuda.device_count()} visible (use --device cpu "
                         "for a functional run on CPU ranks)")
    model_family = family(args.architecture)
    config = model_config(args)
    args.methods = args.methods.split(",")
    plans_for(2, args.methods)  # refuses unknown methods before any rank starts
    args.variants = bench_variants(args, model_family)
    args.baseline = baseline_variant(args.variants)
    args.sizes = model_sizes(args, config)
    if args.traces:
        args.traces.mkdir(parents=True, exist_ok=True)


def bench_variants(args: argparse.Namespace, model_family: Family) -> list[str]:
    """--variants as a list, checked; by default every variant, fp8 left out (and said so) where the family or the
    hardware has none. fp8 asked for by name where it cannot run is refused."""
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    if "fp8" not in variants:
        return variants
    try:
        if not model_family.supports_fp8:
            raise Fp8Unsupported(f"{args.architecture} has no FP8 weights")
        check_fp8_device(torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu"))
    except Fp8Unsupported as error:
        if args.variants:
            raise ValueError(f"{error}; leave fp8 out of --variants") from None
        print(f"skipped the fp8 variant: {error}", flush=True)
        variants.remove("fp8")
    return variants


def baseline_variant(variants: list[str]) -> str:
    """The variant whose 1-GPU forward speed-ups and errors are measured against: compiled (what the server runs)
    where measured, else the first."""
    return "compiled" if "compiled" in variants else variants[0]


def measure(args: argparse.Namespace, work_dir: str) -> tuple[list[dict], list[dict]]:
    """Our engine's forward rows and attention rows for every GPU count of a prepared run, each count in its own rank
    processes; the outputs at the first size are left in work_dir for add_errors."""
    rows, attention_rows = [], []
    for world_size in args.counts:
        problem = run_ranks(_rank_main, world_size, (args, work_dir))
        if problem:
            raise RuntimeError(problem)
        results = json.loads((Path(work_dir) / f"rows-{world_size}.json").read_text())
        rows += results["forward"]
        attention_rows += results["attention"]
    return rows, attention_rows


def report(args: argparse.Namespace, rows: list[dict], attention_rows: list[dict], data: dict) -> str:
    """Print the tables, write them and `data` with the rows (results.md, results.json) and the speed-up plot to
    --output-dir; returns the tables."""
    config = model_config(args)
    shape = family(args.architecture).attention_shape(config)
    tables = (f"One forward of the whole transformer ({args.architecture} {args.preset}):\n\n"
              f"{forward_table(rows, shape, args.baseline)}\n\n{kinds_table(rows)}"
              f"One block's attention alone (communication included):\n\n{attention_table(attention_rows, shape)}\n")
    print(tables)
    write_results(args.output_dir, tables, {"architecture": args.architecture, "preset": args.preset,
                                            "forward": rows, "attention": attention_rows, **data})
    plot(rows, args.output_dir / "speedup.png", args.baseline)
    print(f"wrote {args.output_dir / 'results.json'}, results.md and speedup.png")
    return tables


def run(args: argparse.Namespace) -> int:
    prepare(args)
    with tempfile.TemporaryDirectory() as work_dir:
        rows, attention_rows = measure(args, work_dir)
        add_errors(rows, str(args.sizes[0]), work_dir, args.baseline)
    report(args, rows, attention_rows, {})
    return 0
