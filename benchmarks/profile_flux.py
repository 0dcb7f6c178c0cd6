"""Where a 1-GPU FLUX forward spends its GPU time, by kernel kind: ours (compiled, eager or FP8) or diffusers'
(eager or torch.compile), FLUX.1-dev size, random bf16 weights, batch 1. Prints the time per kind (GEMMs,
attention, fused Triton kernels, other) and the largest kernels, from one profiled forward after warm-up. Ours is
loaded as the server loads it and runs as the server runs it (the benchmark harness, mdtriton/harness.py: its
forward, CUDA graphs included where the server replays them).

    python benchmarks/profile_flux.py --impl mdtriton --variant compiled --image-tokens 4096
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG
from mdtriton.harness import bench_engine, bench_weights, flux_inputs, markdown_table

KINDS = (("attention", ("attention", "fmha", "flash", "cudnn")), ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "gemv")),
         ("fused (Triton)", ("triton_",)))


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, marks in KINDS if any(mark in name for mark in marks)), "other")


def model_for(impl: str, variant: str, device: torch.device):
    if impl == "diffusers":
        from diffusers import FluxTransformer2DModel

        with device:
            model = FluxTransformer2DModel(**{**FLUX_DEV_CONFIG, "axes_dims_rope": tuple(FLUX_DEV_CONFIG["axes_dims_rope"])})
        model = model.to(torch.bfloat16).eval()
        model = torch.compile(model) if variant == "compiled" else model
        return lambda inputs: model(**inputs, return_dict=False)
    quantization = "fp8" if variant == "fp8" else None
    weights = bench_weights("flux", FLUX_DEV_CONFIG, ParallelPlan(), 0, device, torch.bfloat16, quantization)
    engine = bench_engine("flux", FLUX_DEV_CONFIG, Communicator.single(device), weights, "BF16", quantization,
                          compiled=variant != "eager")
    return engine.forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=("mdtriton", "diffusers"), default="mdtriton")
    parser.add_argument("--variant", choices=("compiled", "eager", "fp8"), default="compiled")
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device = torch.device("cuda")
    forward = model_for(args.impl, args.variant, device)
    inputs = flux_inputs(FLUX_DEV_CONFIG, args.text_tokens, args.image_tokens, device)
    with torch.inference_mode(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        for _ in range(3):
            forward(inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            forward(inputs)
            torch.cuda.synchronize()
    kernels = [e for e in profiler.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels) / 1000
    by_kind = defaultdict(float)
    for event in kernels:
        by_kind[kind_of(event.key)] += event.self_device_time_total / 1000
    print(f"{args.impl} {args.variant}, {args.image_tokens:,}+{args.text_tokens} tokens: {total:.1f} ms of kernels")
    print(markdown_table(["kind", "ms", "share"], [[kind, f"{ms:.1f}", f"{100 * ms / total:.0f}%"]
                                                   for kind, ms in sorted(by_kind.items(), key=lambda item: -item[1])]))
    print(markdown_table(["kernel", "calls", "ms"],
                         [[event.key[:110], event.count, f"{event.self_device_time_total / 1000:.2f}"]
                          for event in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.top]]))


if __name__ == "__main__":
    main()
