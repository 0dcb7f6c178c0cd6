"""The inputs of linear layers, made in one pass over their rows: FLUX's modulated LayerNorm (AdaLN:
norm(x) * (1 + scale) + shift), the tanh GELU, and, for FP8 layers, the e4m3 values with one scale per row that the
FP8 GEMM takes (mdtriton.engine.fp8), each fused into the other.

Compiled by Inductor (with symbolic sizes, kernel configurations picked without timing) these ran at a third to
a half of the GPU's memory bandwidth, and the FP8 quantization after a GELU read the GELU's output again: on an
H200 they took 21 ms of a 97 ms FP8 FLUX.1-dev forward at 4,096 + 512 tokens (docs/benchmarks.md). On CUDA each
op here is one Triton kernel that reads a row once and writes it once; elsewhere it is the same math in PyTorch.
They are custom ops, so torch.compile calls them as they are.

Rounding: the kernels compute in float32 and round once at the end, as Inductor's fused code did. Quantized
rows are quantized from their bf16 values (the GEMM input that an unfused layer would have quantized), so the
scales are those of mdtriton.engine.fp8.quantize_rows.
"""

import torch
import torch.nn.functional as F

from mdtriton.engine.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, Fp8Rows, quantize_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch: the PyTorch implementations serve
    triton = None

LAYER_NORM_EPS = 1e-6  # every FLUX LayerNorm's
# (No postponed annotations in this module: custom_op reads the schemas from them.)


def uses_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None


def modulate_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LayerNorm of x [B, S, N] (no weights), times 1 + scale, plus shift (both [B, N]), as diffusers computes it."""
    return F.layer_norm(x, x.shape[-1:], eps=LAYER_NORM_EPS) * (1 + scale[:, None]) + shift[:, None]


@torch.library.custom_op("mdtriton::modulated_layer_norm", mutates_args=())
def modulated_layer_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift for x [B, S, N] and shift, scale [B, N] (one pair per sample)."""
    if not uses_triton(x):
        return modulate_reference(x, shift, scale)
    x = x.contiguous()
    out = torch.empty_like(x)
    _launch_modulated_norm(x, shift, scale, out, None)
    return out


@modulated_layer_norm.register_fake
def _(x, shift, scale):
    return torch.empty_like(x)


@torch.library.custom_op("mdtriton::modulated_layer_norm_fp8", mutates_args=())
def _modulated_layer_norm_fp8(x: torch.Tensor, shift: torch.Tensor,
                              scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not uses_triton(x):
        return quantize_rows(modulate_reference(x, shift, scale))
    x = x.contiguous()
    values, scales = torch.empty_like(x, dtype=FP8_DTYPE), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)
    _launch_modulated_norm(x, shift, scale, values, scales)
    return values, scales


@_modulated_layer_norm_fp8.register_fake
def _(x, shift, scale):
    return torch.empty_like(x, dtype=FP8_DTYPE), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


def modulated_layer_norm_fp8(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> Fp8Rows:
    """modulated_layer_norm(x, shift, scale), rounded to x's dtype, quantized to e4m3 per row (token)."""
    return Fp8Rows(*_modulated_layer_norm_fp8(x, shift, scale), x.dtype)


@torch.library.custom_op("mdtriton::rows_to_fp8", mutates_args=())
def _rows_to_fp8(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not uses_triton(x):
        return quantize_rows(F.gelu(x, approximate="tanh") if gelu else x)
    x = x.contiguous()
    values, scales = torch.empty_like(x, dtype=FP8_DTYPE), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)
    width = x.shape[-1]
    block = triton.next_power_of_2(width)
    _rows_to_fp8_kernel[(x.numel() // width,)](x, values, scales, width, FP8_MAX, SCALE_FLOOR, GELU=gelu, BLOCK=block,
                                               num_warps=warps_for(block))
    return values, scales


@_rows_to_fp8.register_fake
def _(x, gelu):
    return torch.empty_like(x, dtype=FP8_DTYPE), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


def rows_to_fp8(x: torch.Tensor, gelu: bool = False) -> Fp8Rows:
    """x [..., K] (or its tanh GELU, rounded to x's dtype) quantized to e4m3 per row: mdtriton.engine.fp8's
    quantize_rows in one pass."""
    return Fp8Rows(*_rows_to_fp8(x, gelu), x.dtype)


def warps_for(block: int) -> int:
    """Warps for a program that holds one row of `block` elements: about 32 elements per thread, 4 to 16 warps."""
    return max(4, min(16, block // 1024))


def _launch_modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                           scales: torch.Tensor | None) -> None:
    batch, tokens, width = x.shape
    if shift.stride(-1) != 1 or scale.stride(-1) != 1 or shift.stride(0) != scale.stride(0):
        shift, scale = shift.contiguous(), scale.contiguous()
    block = triton.next_power_of_2(width)
    _modulated_norm_kernel[(batch * tokens,)](x, shift, scale, out, scales, tokens, width, shift.stride(0),
                                              LAYER_NORM_EPS, FP8_MAX, SCALE_FLOOR, QUANTIZE=scales is not None,
                                              BLOCK=block, num_warps=warps_for(block))


if triton is not None:
    @triton.jit
    def _store_row(out, scales, row, cols, mask, y, fp8_max, scale_floor, QUANTIZE: tl.constexpr):
        """Store one row y (float32) at out: rounded to out's dtype, or, with QUANTIZE, as e4m3 with its scale
        (amax / fp8_max) in scales[row]. The caller rounds y to the unfused layer input's dtype before quantizing."""
        if QUANTIZE:
            scale = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0), scale_floor) / fp8_max
            tl.store(scales + row, scale)
            y = tl.clamp(y / scale, -fp8_max, fp8_max)
        tl.store(out + cols, y.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _modulated_norm_kernel(x, shift, scale, out, scales, tokens, width, modulation_stride, eps, fp8_max,
                               scale_floor, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr):
        """One program: one row (token) of x [B * S, N]."""
        row = tl.program_id(0)
        sample = row // tokens
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        start = row.to(tl.int64) * width
        values = tl.load(x + start + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(values, axis=0) / width
        centered = tl.where(mask, values - mean, 0.0)
        normed = centered * tl.rsqrt(tl.sum(centered * centered, axis=0) / width + eps)
        modulation = sample * modulation_stride + cols
        scale_ = tl.load(scale + modulation, mask=mask, other=0.0).to(tl.float32)
        shift_ = tl.load(shift + modulation, mask=mask, other=0.0).to(tl.float32)
        y = normed * (1 + scale_) + shift_
        if QUANTIZE:
            y = y.to(x.dtype.element_ty).to(tl.float32)
        _store_row(out + start, scales, row, cols, mask, y, fp8_max, scale_floor, QUANTIZE)

    @triton.jit
    def _rows_to_fp8_kernel(x, out, scales, width, fp8_max, scale_floor, GELU: tl.constexpr, BLOCK: tl.constexpr):
        """One program: one row of x [rows, K]; with GELU, the tanh GELU of it, rounded to x's dtype."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        start = row.to(tl.int64) * width
        values = tl.load(x + start + cols, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
            values = values * tl.sigmoid(1.5957691216057308 * (values + 0.044715 * values * values * values))
            values = values.to(x.dtype.element_ty).to(tl.float32)
        _store_row(out + start, scales, row, cols, mask, values, fp8_max, scale_floor, True)
