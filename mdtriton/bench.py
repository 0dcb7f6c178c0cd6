"""`mdtriton bench`: one FLUX transformer forward per GPU count x parallel method x variant x sequence length.

Built on the benchmark harness (mdtriton/harness.py), as the scripts in benchmarks/ are. Each GPU count runs in its
own set of processes (one per GPU, NCCL). Weights are random, made on each
GPU shard by shard from one seed (the same full model for every plan), bf16, with trained-like scales
(modulation weights x 0.1, so the gates stay small: see docs/benchmarks.md, "Accuracy"). The engine is loaded
as the server loads it (TorchEngine.from_weights) and timed through its forward. Variants:
`compiled` (what the server runs on GPUs: fused projections, compiled blocks, warmed up at load, short
requests replayed as CUDA graphs), `eager` (the same module uncompiled, no graphs), `fp8` (FP8 weights, as
compiled). Timing: the first call at each length after
the warm-up (a recompile would show here), then warm-up runs, then CUDA-event times of whole forwards
between barriers; the median is reported. One more forward runs under the PyTorch profiler to find the
share of GPU time spent in NCCL kernels. At --check-tokens every output is compared with the 1-GPU compiled
output and with a float32 forward of the same weights. A second table times one block's attention
alone (the method's communication included) against cuDNN's attention on one GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from mdtriton.engine.attention import attention_for
from mdtriton.engine.attention.local import cudnn_sdpa
from mdtriton.engine.comm import Communicator
from mdtriton.engine.fp8 import check_fp8_device
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.harness import (attention_flops, bench_engine, bench_weights, flux_inputs, init_rank, markdown_table,
                              plans_for, relative_error, run_ranks, time_calls, timing, write_results)

METHODS = ("allgather_kv", "ring", "ulysses", "tp", "tp_cp")
VARIANTS = ("compiled", "eager", "fp8")


def communication_share(call) -> float:
    """Share of one call's GPU kernel time spent in NCCL kernels (which may overlap compute)."""
    from torch.profiler import ProfilerActivity, profile

    if dist.is_initialized():
        dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        call()
        torch.cuda.synchronize()
    events = [e for e in profiler.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    nccl = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
    return nccl / total if total else 0.0


def attention_inputs(config: dict, plan: ParallelPlan, tokens: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One block's q, k, v [1, heads per TP rank, tokens per CP rank, head_dim] for a joint sequence of tokens."""
    generator = torch.Generator(device).manual_seed(1)
    local_len = -(-tokens // plan.cp_size)
    shape = (1, config["num_attention_heads"] // plan.tp_size, local_len, config["attention_head_dim"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return tuple(torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(3))


def sample_file(world_size: int, method: str, variant: str, image_tokens: int) -> str:
    return f"sample-{world_size}-{method}-{variant}-{image_tokens}.safetensors"


def save_sample(sample: torch.Tensor, path: Path) -> None:
    save_file({"sample": sample.cpu().contiguous()}, path)


def load_sample(path: Path) -> torch.Tensor:
    return load_file(path)["sample"]


def float32_samples(config: dict, device: torch.device, args: argparse.Namespace, work_dir: str) -> None:
    """The 1-GPU model with the same bf16 weights but float32 activations, at the check lengths: the bf16
    engine's own rounding error shows against it, one GPU's included."""
    weights = bench_weights(config, ParallelPlan(), 0, device, torch.bfloat16, None)
    engine = bench_engine("flux", config, Communicator.single(device),
                          {name: tensor.float() for name, tensor in weights.items()}, "FP32", compiled=False)
    del weights
    for image_tokens in args.check_tokens:
        inputs = {name: t.float() for name, t in flux_inputs(config, args.text_tokens, image_tokens, device).items()}
        save_sample(engine.forward(inputs)["sample"], Path(work_dir) / sample_file(1, "1 GPU", "float32", image_tokens))
    del engine


def add_errors(rows: list[dict], work_dir: str) -> None:
    """Each checked row's relative error (norm) against the 1-GPU compiled bf16 output and the float32 output."""
    for row in rows:
        path = Path(work_dir) / sample_file(row["gpus"], row["method"], row["variant"], row["image_tokens"])
        if not path.exists():
            continue
        sample = load_sample(path)
        for reference, key in (("compiled", "error_vs_1gpu"), ("float32", "error_vs_float32")):
            reference_path = Path(work_dir) / sample_file(1, "1 GPU", reference, row["image_tokens"])
            if reference_path.exists():
                row[key] = relative_error(sample, load_sample(reference_path))


def bench_config(args: argparse.Namespace) -> dict:
    return {**FLUX.presets()[args.preset], **json.loads(args.config)}


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, work_dir: str) -> None:
    cuda = args.device == "cuda"
    device = init_rank(rank, world_size, port, cuda)
    config = bench_config(args)
    dtype, data_type = (torch.bfloat16, "BF16") if cuda else (torch.float32, "FP32")
    rows, attention_rows = [], []
    for method, plan in plans_for(world_size, args.methods).items():
        comm = Communicator(plan, rank, device)
        comm.join_groups()
        for variant in args.variants:
            quantization = "fp8" if variant == "fp8" else None
            engine = bench_engine("flux", config, comm, bench_weights(config, plan, rank, device, dtype, quantization),
                                  data_type, quantization, compiled=variant != "eager")
            for image_tokens in args.image_tokens:
                inputs = flux_inputs(config, args.text_tokens, image_tokens, device)
                first, _ = time_calls(lambda: engine.forward(inputs)["sample"], cuda, 0, 1)
                times, output = time_calls(lambda: engine.forward(inputs)["sample"], cuda, args.warmup,
                                           args.iterations)
                share = communication_share(lambda: engine.forward(inputs)) if cuda and world_size > 1 else 0.0
                row = {"gpus": world_size, "method": method, "variant": variant, "plan": str(plan),
                       "image_tokens": image_tokens, "text_tokens": args.text_tokens, **timing(times),
                       "first_ms": first[0], "warm_up_s": engine.warm_up_seconds, "communication_share": share}
                if image_tokens in args.check_tokens and rank == 0:
                    save_sample(output, Path(work_dir) / sample_file(world_size, method, variant, image_tokens))
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
            engine = None  # free this variant's weights before the next ones are made
            if cuda:
                torch.cuda.empty_cache()
        for image_tokens in args.image_tokens:
            tokens = image_tokens + args.text_tokens
            q, k, v = attention_inputs(config, plan, tokens, device)
            attention = attention_for(plan)
            with torch.inference_mode():
                times, _ = time_calls(lambda: attention(q, k, v, comm, tokens), cuda, args.warmup, 5 * args.iterations)
            attention_rows.append({"gpus": world_size, "method": method, "image_tokens": image_tokens,
                                   "text_tokens": args.text_tokens, "median_ms": timing(times)["median_ms"]})
    if world_size == 1:
        float32_samples(config, device, args, work_dir)
        # cuDNN's attention alone over the whole sequence: the rate the engine's attention is held against.
        for image_tokens in args.image_tokens:
            tokens = image_tokens + args.text_tokens
            q, k, v = attention_inputs(config, ParallelPlan(), tokens, device)
            with torch.inference_mode():
                times, _ = time_calls(lambda: cudnn_sdpa(q, k, v), cuda, args.warmup, 5 * args.iterations)
            attention_rows.append({"gpus": 1, "method": "cuDNN SDPA", "image_tokens": image_tokens,
                                   "text_tokens": args.text_tokens, "median_ms": timing(times)["median_ms"]})
    if rank == 0:
        with open(Path(work_dir) / f"rows-{world_size}.json", "w") as handle:
            json.dump({"forward": rows, "attention": attention_rows}, handle)
    if dist.is_initialized():
        dist.destroy_process_group()


def forward_table(rows: list[dict], config: dict) -> str:
    """Speed-ups are over the 1-GPU compiled bf16 forward (our fastest bf16 base)."""
    single = {r["image_tokens"]: r["median_ms"] for r in rows if r["method"] == "1 GPU" and r["variant"] == "compiled"}
    blocks = config["num_layers"] + config["num_single_layers"]
    header = ["image+text tokens", "GPUs", "method", "variant", "plan", "median ms", "first call ms", "warm-up s",
              "speedup", "efficiency", "attention-equivalent TFLOP/s per GPU", "NCCL share of GPU time",
              "rel. error vs 1 GPU compiled / vs float32"]
    cells = []
    for r in sorted(rows, key=lambda r: (r["image_tokens"], r["gpus"], r["method"], r["variant"])):
        speedup = single.get(r["image_tokens"], float("nan")) / r["median_ms"]
        tflops = attention_flops(r["image_tokens"] + r["text_tokens"], config) * blocks / r["gpus"] / r["median_ms"] / 1e9
        error = " / ".join(f"{r[key]:.1e}" if key in r else "-" for key in ("error_vs_1gpu", "error_vs_float32"))
        cells.append([f"{r['image_tokens']:,}+{r['text_tokens']}", r["gpus"], r["method"], r["variant"], r["plan"],
                      f"{r['median_ms']:.1f}", f"{r['first_ms']:.1f}", f"{r['warm_up_s']:.0f}", f"{speedup:.2f}x",
                      f"{100 * speedup / r['gpus']:.0f}%", f"{tflops:.0f}", f"{100 * r['communication_share']:.0f}%",
                      "" if error == "- / -" else error])
    return markdown_table(header, cells)


def attention_table(rows: list[dict], config: dict) -> str:
    cudnn = {r["image_tokens"]: r["median_ms"] for r in rows if r["method"] == "cuDNN SDPA"}
    header = ["image+text tokens", "GPUs", "method", "median ms (one block)", "TFLOP/s per GPU",
              "% of 1-GPU cuDNN rate"]
    cells = []
    for r in sorted(rows, key=lambda r: (r["image_tokens"], r["gpus"], r["method"])):
        tflops = attention_flops(r["image_tokens"] + r["text_tokens"], config) / r["gpus"] / r["median_ms"] / 1e9
        base = attention_flops(r["image_tokens"] + r["text_tokens"], config) / cudnn[r["image_tokens"]] / 1e9
        cells.append([f"{r['image_tokens']:,}+{r['text_tokens']}", r["gpus"], r["method"], f"{r['median_ms']:.2f}",
                      f"{tflops:.0f}", f"{100 * tflops / base:.0f}%"])
    return markdown_table(header, cells)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["image_tokens"] for r in rows})
    figure, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for axis, length in zip(axes[0], lengths):
        compiled = [r for r in rows if r["variant"] == "compiled"]
        single = next((r["median_ms"] for r in compiled if r["method"] == "1 GPU" and r["image_tokens"] == length), None)
        for method in sorted({r["method"] for r in compiled if r["gpus"] > 1}):
            points = sorted((r["gpus"], single / r["median_ms"]) for r in compiled
                            if r["method"] == method and r["image_tokens"] == length and single)
            axis.plot([1] + [p[0] for p in points], [1.0] + [p[1] for p in points], marker="o", label=method)
        gpus = sorted({r["gpus"] for r in rows})
        axis.plot(gpus, gpus, linestyle="--", color="gray", label="ideal")
        axis.set(title=f"{length:,} image + {rows[0]['text_tokens']} text tokens", xlabel="GPUs", ylabel="speedup over 1 GPU")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="measure the FLUX engine on 1..N GPUs per parallel method",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts to measure (default 1,2,4; 1 is the baseline)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"methods (default {','.join(METHODS)})")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"compiled (as served), eager, fp8 (FP8 weights, compiled; GPUs of compute capability "
                             f"8.9+) (default {','.join(VARIANTS)})")
    parser.add_argument("--image-tokens", default="4096,16384,65536", help="image sequence lengths")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--preset", default="flux.1-dev", choices=sorted(FLUX.presets()),
                        help="FLUX size (default flux.1-dev)")
    parser.add_argument("--config", default="{}", help="JSON overriding the preset's config")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--check-tokens", default="4096", help="lengths at which outputs are compared with 1 GPU")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (default when there is a GPU) or cpu: gloo ranks, float32, for checking the tool")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    counts = [int(g) for g in args.gpus.split(",")]
    if args.device == "cuda" and max(counts) > torch.cuda.device_count():
        raise ValueError(f"asked for {max(counts)} GPUs, {torch.cuda.device_count()} visible (use --device cpu "
                         "for a functional run on CPU ranks)")
    args.methods = args.methods.split(",")
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    if "compiled" not in args.variants:
        raise ValueError("--variants needs compiled: speed-ups and errors are measured against it")
    if "fp8" in args.variants:
        check_fp8_device(torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu"))
    args.image_tokens = [int(n) for n in args.image_tokens.split(",")]
    args.check_tokens = [int(n) for n in args.check_tokens.split(",")]
    config = bench_config(args)
    rows, attention_rows = [], []
    with tempfile.TemporaryDirectory() as work_dir:
        for world_size in sorted(set(counts) | {1}):
            problem = run_ranks(_rank_main, world_size, (args, work_dir))
            if problem:
                raise RuntimeError(problem)
            results = json.loads((Path(work_dir) / f"rows-{world_size}.json").read_text())
            rows += results["forward"]
            attention_rows += results["attention"]
        add_errors(rows, work_dir)
    tables = (f"One forward of the whole transformer:\n\n{forward_table(rows, config)}\n\n"
              f"One block's attention alone (communication included):\n\n{attention_table(attention_rows, config)}\n")
    print(tables)
    write_results(args.output_dir, tables, {"forward": rows, "attention": attention_rows})
    plot(rows, args.output_dir / "speedup.png")
    print(f"wrote {args.output_dir / 'results.json'}, results.md and speedup.png")
    return 0
