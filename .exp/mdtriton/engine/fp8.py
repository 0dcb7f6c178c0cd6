"""FP8 (e4m3) linear layers: weights quantized per output row at build time, activations per token at run time.

A GEMM on Hopper runs at 1.5-1.8x the bf16 rate in FP8 (docs/benchmarks.md), but only if quantizing the
activation costs little: done as separate eager steps it made the layer slower than bf16. In the engine the
kernel that produces an activation also quantizes it (mdtriton.engine.fused_activations: after the modulated
LayerNorm, the GELU, or in one pass over the attention output) and hands the GEMM an `Fp8Rows`; `fp8_linear`
quantizes a plain tensor itself. The GEMM is `torch._scaled_mm` with row-wise scales
(the kernel torchao's float8 inference path calls too), bias and bf16 output in the GEMM.
Weights and scales are ordinary safetensors tensors (`NAME.weight` in float8_e4m3fn, `NAME.weight_scale` in
float32, one per output row), so an FP8 engine needs no tensor subclasses to load.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Scaled-mm kernels with row-wise scales exist for compute capability 8.9 (Ada) and newer.
FP8_MIN_CAPABILITY = (8, 9)
# A row of zeros would give a zero scale; any tiny positive floor keeps the division finite.
SCALE_FLOOR = 1e-12


class Fp8Rows(NamedTuple):
    """An activation quantized per row (token), as the FP8 GEMM takes it: x ~= values * scale."""

    values: torch.Tensor  # e4m3 [..., K]
    scale: torch.Tensor  # float32 [..., 1]
    dtype: torch.dtype  # x's, which the GEMM's output takes


class Fp8Unsupported(RuntimeError):
    """This device cannot run FP8 GEMMs; the message says what to build instead."""


def check_fp8_device(device: torch.device) -> None:
    """Raise Fp8Unsupported, saying what to do, unless device can run FP8 GEMMs with row-wise scales."""
    device = torch.device(device)
    if device.type != "cuda":
        raise Fp8Unsupported(f"FP8 engines run on NVIDIA GPUs of compute capability 8.9 or newer (Ada, Hopper, "
                             f"Blackwell), not on {device.type}; build with --dtype BF16 (or FP32 for CPU ranks)")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise Fp8Unsupported(f"FP8 engines need a GPU of compute capability 8.9 or newer; GPU {device.index} "
                             f"({torch.cuda.get_device_name(device)}) is {capability[0]}.{capability[1]}: build with "
                             "--dtype BF16")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 values, float32 scales [..., 1]) with x ~= values * scales, one scale per row."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=SCALE_FLOOR) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [out, in] -> (e4m3 weight [out, in], float32 scale [out]): one scale per output row."""
    values, scale = quantize_rows(weight)
    return values, scale.squeeze(-1)


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for an e4m3 weight [out, in] with row scales [out]; x [..., in] is quantized per token, unless it
    comes quantized."""
    if not isinstance(x, Fp8Rows):
        x = Fp8Rows(*quantize_rows(x), x.dtype)
    shape = x.values.shape
    out = torch._scaled_mm(x.values.reshape(-1, shape[-1]), weight.t(), scale_a=x.scale.reshape(-1, 1),
                           scale_b=weight_scale[None, :], bias=bias, out_dtype=x.dtype)
    return out.reshape(*shape[:-1], weight.shape[0])
