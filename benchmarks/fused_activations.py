"""The kernels of mdtriton.engine.fused_activations at FLUX.1-dev's shapes, for several launch configurations
(rows per program and warps; warps for the GELU kernel), against Inductor's code for the
same math (torch.compile with symbolic sizes, as the engine compiles its blocks) and against the GPU's copy
bandwidth: time and GB/s (bytes read once and written once). The configuration the engine uses is marked.

    python benchmarks/fused_activations.py --tokens 4608,16896
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from mdtriton.engine.fp8 import FP8_DTYPE, quantize_rows
from mdtriton.engine.fused_activations import (GELU_WARPS, launch_config, launch_gelu_rows_to_fp8,
                                               launch_modulated_norm, launch_rows_to_fp8, modulate_reference)
from mdtriton.harness import markdown_table

DIM, MLP = 3072, 12288
ROW_CONFIGS = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8)]  # (rows per program, warps)
GELU_CONFIGS = [(4,), (8,), (16,), (32,)]  # (warps,)


def median_us(call) -> float:
    return 1000 * triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")


def cases(tokens: int):
    """(name, bytes moved, Inductor's version, our launcher taking a configuration, its configurations, the
    engine's)."""
    x = torch.randn(1, tokens, DIM, device="cuda", dtype=torch.bfloat16)
    shift, scale = (0.5 * torch.randn(1, 2 * DIM, device="cuda", dtype=torch.bfloat16)).chunk(2, dim=1)
    h = torch.randn(1, tokens, MLP, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    values, scales = torch.empty_like(x, dtype=FP8_DTYPE), torch.empty(1, tokens, 1, device="cuda")
    h_values, h_scales = torch.empty_like(h, dtype=FP8_DTYPE), torch.empty(1, tokens, 1, device="cuda")
    joint_values = torch.empty(1, tokens, DIM + MLP, device="cuda", dtype=FP8_DTYPE)
    compiled_norm = torch.compile(modulate_reference, dynamic=True)
    compiled_norm_fp8 = torch.compile(lambda x, s, c: quantize_rows(modulate_reference(x, s, c)), dynamic=True)
    compiled_quantize = torch.compile(quantize_rows, dynamic=True)
    compiled_gelu_fp8 = torch.compile(lambda h: quantize_rows(F.gelu(h, approximate="tanh")), dynamic=True)
    compiled_joint = torch.compile(lambda x, h: quantize_rows(torch.cat((x, F.gelu(h, approximate="tanh")), -1)),
                                   dynamic=True)
    return [
        ("modulated norm, bf16 out", 4 * x.numel(), lambda: compiled_norm(x, shift, scale),
         lambda r, w: launch_modulated_norm(x, shift, scale, out, None, r, w), ROW_CONFIGS, launch_config(DIM)),
        ("modulated norm, FP8 out", 3 * x.numel(), lambda: compiled_norm_fp8(x, shift, scale),
         lambda r, w: launch_modulated_norm(x, shift, scale, values, scales, r, w), ROW_CONFIGS, launch_config(DIM)),
        ("quantize attention output", 3 * x.numel(), lambda: compiled_quantize(x),
         lambda r, w: launch_rows_to_fp8(x, values, scales, r, w), ROW_CONFIGS, launch_config(DIM)),
        ("GELU + quantize MLP", 3 * h.numel(), lambda: compiled_gelu_fp8(h),
         lambda w: launch_gelu_rows_to_fp8(None, h, h_values, h_scales, w), GELU_CONFIGS, (GELU_WARPS,)),
        ("[attention | GELU] + quantize", 3 * (x.numel() + h.numel()), lambda: compiled_joint(x, h),
         lambda w: launch_gelu_rows_to_fp8(x, h, joint_values, h_scales, w), GELU_CONFIGS, (GELU_WARPS,)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4608,16896")
    args = parser.parse_args()
    copy = torch.empty(2 ** 28, device="cuda", dtype=torch.bfloat16)
    copy_rate = 2 * copy.numel() * 2 / median_us(lambda: copy.clone()) / 1e3
    print(f"{torch.cuda.get_device_name()}: a 512 MiB device copy moves {copy_rate:.0f} GB/s (read + write)\n")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, moved, inductor, ours, configs, engine_config in cases(tokens):
            inductor_us = median_us(inductor)
            for config in configs:
                us = median_us(lambda: ours(*config))
                mark = " (engine)" if config == engine_config else ""
                rows.append([f"{tokens:,}", name, f"{inductor_us:.1f}", f"{config}{mark}", f"{us:.1f}",
                             f"{moved / us / 1e3:.0f}", f"{inductor_us / us:.2f}x"])
    print(markdown_table(["tokens", "kernel", "Inductor us", "config", "us", "GB/s", "vs Inductor"], rows))


if __name__ == "__main__":
    main()
