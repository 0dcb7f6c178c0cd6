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


def empty_fp8_rows(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised e4m3 values [..., width] (x's last size by default) and float32 row scales [..., 1], on x's
    device: what the FP8 ops here return."""
    rows = x.shape[:-1]
    return (x.new_empty(*rows, x.shape[-1] if width is None else width, dtype=FP8_DTYPE),
            x.new_empty(*rows, 1, dtype=torch.float32))


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
    launch_modulated_norm(x, shift, scale, out, None, *launch_config(x.shape[-1]))
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
    values, scales = empty_fp8_rows(x)
    launch_modulated_norm(x, shift, scale, values, scales, *launch_config(x.shape[-1]))
    return values, scales


@_modulated_layer_norm_fp8.register_fake
def _(x, shift, scale):
    return empty_fp8_rows(x)


def modulated_layer_norm_fp8(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> Fp8Rows:
    """modulated_layer_norm(x, shift, scale), rounded to x's dtype, quantized to e4m3 per row (token)."""
    return Fp8Rows(*_modulated_layer_norm_fp8(x, shift, scale), x.dtype)


@torch.library.custom_op("mdtriton::rows_to_fp8", mutates_args=())
def _rows_to_fp8(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not uses_triton(x):
        return quantize_rows(F.gelu(x, approximate="tanh") if gelu else x)
    x = x.contiguous()
    values, scales = empty_fp8_rows(x)
    if gelu:
        launch_gelu_rows_to_fp8(None, x, values, scales, GELU_WARPS)
    else:
        launch_rows_to_fp8(x, values, scales, *launch_config(x.shape[-1]))
    return values, scales


@_rows_to_fp8.register_fake
def _(x, gelu):
    return empty_fp8_rows(x)


def rows_to_fp8(x: torch.Tensor, gelu: bool = False) -> Fp8Rows:
    """x [..., K] (or its tanh GELU, rounded to x's dtype) quantized to e4m3 per row: mdtriton.engine.fp8's
    quantize_rows in one pass."""
    return Fp8Rows(*_rows_to_fp8(x, gelu), x.dtype)


@torch.library.custom_op("mdtriton::attention_and_gelu_to_fp8", mutates_args=())
def _attention_and_gelu_to_fp8(attention: torch.Tensor, mlp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not uses_triton(attention):
        return quantize_rows(torch.cat((attention, F.gelu(mlp, approximate="tanh")), dim=-1))
    attention, mlp = attention.contiguous(), mlp.contiguous()
    values, scales = empty_fp8_rows(attention, attention.shape[-1] + mlp.shape[-1])
    launch_gelu_rows_to_fp8(attention, mlp, values, scales, GELU_WARPS)
    return values, scales


@_attention_and_gelu_to_fp8.register_fake
def _(attention, mlp):
    return empty_fp8_rows(attention, attention.shape[-1] + mlp.shape[-1])


def attention_and_gelu_to_fp8(attention: torch.Tensor, mlp: torch.Tensor) -> Fp8Rows:
    """[attention | tanh-GELU(mlp)] ([..., A] and [..., M] -> [..., A + M]) quantized to e4m3 per row, one scale
    for both parts: the one input of a FLUX single block's FP8 output projection, which then runs as one GEMM (no
    concatenation in bf16, no second GEMM and sum)."""
    return Fp8Rows(*_attention_and_gelu_to_fp8(attention, mlp), attention.dtype)


def launch_config(width: int) -> tuple[int, int]:
    """(rows per program, warps) for the kernels that hold whole rows (the modulated norm, quantizing attention
    outputs), measured fastest on an H200 for FLUX's widths (docs/benchmarks.md). Fixed, not
    autotuned: the configuration decides the order of each row's sums, and every process must compute the same
    bits."""
    block = triton.next_power_of_2(width)
    return max(1, 2048 // block), max(4, min(16, block // 1024))


# Warps of the GELU kernel, which holds one MLP row (12,288 wide in FLUX.1-dev) and, in single blocks, the attention
# output's row before it: 8 was the fastest on an H200 (docs/benchmarks.md).
GELU_WARPS = 8


def launch_modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                          scales: torch.Tensor | None, rows_per_program: int, warps: int) -> None:
    """The modulated norm kernel over contiguous x [B, S, N] into out (and with scales, quantized)."""
    batch, tokens, width = x.shape
    if shift.stride(-1) != 1 or scale.stride(-1) != 1 or shift.stride(0) != scale.stride(0):
        shift, scale = shift.contiguous(), scale.contiguous()
    rows = batch * tokens
    _modulated_norm_kernel[(triton.cdiv(rows, rows_per_program),)](
        x, shift, scale, out, scales, rows, tokens, width, shift.stride(0), LAYER_NORM_EPS, FP8_MAX, 1 / FP8_MAX,
        SCALE_FLOOR, QUANTIZE=scales is not None, ROWS=rows_per_program, BLOCK=triton.next_power_of_2(width),
        num_warps=warps)


def launch_rows_to_fp8(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, rows_per_program: int,
                       warps: int) -> None:
    """The row quantization kernel over contiguous x [..., K] into values and scales."""
    width = x.shape[-1]
    rows = x.numel() // width
    _rows_to_fp8_kernel[(triton.cdiv(rows, rows_per_program),)](
        x, values, scales, rows, width, FP8_MAX, 1 / FP8_MAX, SCALE_FLOOR, ROWS=rows_per_program,
        BLOCK=triton.next_power_of_2(width), num_warps=warps)


def launch_gelu_rows_to_fp8(head: torch.Tensor | None, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                            warps: int) -> None:
    """The GELU kernel: rows of [head | GELU(x)] (head may be None) from contiguous tensors into values and scales,
    one program per row."""
    width_head = 0 if head is None else head.shape[-1]
    width = x.shape[-1]
    rows = x.numel() // width
    _gelu_rows_to_fp8_kernel[(rows,)](
        x if head is None else head, x, values, scales, rows, width_head, width, FP8_MAX, 1 / FP8_MAX, SCALE_FLOOR,
        HEAD=head is not None, BLOCK_HEAD=triton.next_power_of_2(max(width_head, 1)),
        BLOCK=triton.next_power_of_2(width), num_warps=warps)


if triton is not None:
    @triton.jit
    def _store_rows(out, scales, row, rows, offsets, mask, y, fp8_max, inverse_fp8_max, scale_floor,
                    QUANTIZE: tl.constexpr):
        """Store rows y [ROWS, BLOCK] (float32) at out + offsets: rounded to out's dtype, or, with QUANTIZE, as e4m3
        with each row's scale (amax / fp8_max) in scales[row]. The caller rounds y to the unfused layer input's
        dtype before quantizing."""
        if QUANTIZE:
            scale = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1), scale_floor) * inverse_fp8_max
            tl.store(scales + row, scale, mask=row < rows)
            y = tl.clamp(y * (1 / scale)[:, None], -fp8_max, fp8_max)
        tl.store(out + offsets, y.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _row_block(program, rows, width, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's rows, their elements' offsets in a [rows, width] tensor, and which of those exist."""
        row = program * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (row < rows)[:, None] & (cols < width)[None, :]
        return row, cols, row.to(tl.int64)[:, None] * width + cols[None, :], mask

    # Sizes that change with the request are not specialised on (Triton would compile a variant for sizes divisible
    # by 16, say, at the first request of such a size: a compile after the warm-up).
    @triton.jit(do_not_specialize=["rows", "tokens"])
    def _modulated_norm_kernel(x, shift, scale, out, scales, rows, tokens, width, modulation_stride, eps, fp8_max,
                               inverse_fp8_max, scale_floor, QUANTIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """One program: ROWS rows (tokens) of x [B * S, N]."""
        row, cols, offsets, mask = _row_block(tl.program_id(0), rows, width, ROWS, BLOCK)
        values = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(values, axis=1) / width
        centered = tl.where(mask, values - mean[:, None], 0.0)
        normed = centered * tl.rsqrt(tl.sum(centered * centered, axis=1) / width + eps)[:, None]
        modulation = (row // tokens)[:, None] * modulation_stride + cols[None, :]
        scale_ = tl.load(scale + modulation, mask=mask, other=0.0).to(tl.float32)
        shift_ = tl.load(shift + modulation, mask=mask, other=0.0).to(tl.float32)
        y = normed * (1 + scale_) + shift_
        if QUANTIZE:
            y = y.to(x.dtype.element_ty).to(tl.float32)
        _store_rows(out, scales, row, rows, offsets, mask, y, fp8_max, inverse_fp8_max, scale_floor, QUANTIZE)

    @triton.jit
    def _gelu(x):
        """tanh GELU of float32 x: 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)."""
        return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))

    @triton.jit(do_not_specialize=["rows"])
    def _gelu_rows_to_fp8_kernel(head, x, out, scales, rows, width_head, width, fp8_max, inverse_fp8_max,
                                 scale_floor, HEAD: tl.constexpr, BLOCK_HEAD: tl.constexpr, BLOCK: tl.constexpr):
        """One program: one row of [head | GELU(x)] (head [rows, H] if HEAD, x [rows, K]) into out [rows, H + K] as
        e4m3, one scale for the row. x's GELU is rounded to x's dtype first."""
        row, cols, offsets, mask = _row_block(tl.program_id(0), rows, width, 1, BLOCK)
        values = _gelu(tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32))
        values = values.to(x.dtype.element_ty).to(tl.float32)
        largest = tl.max(tl.where(mask, tl.abs(values), 0.0), axis=1)
        out_row = row.to(tl.int64)[:, None] * (width_head + width)
        if HEAD:
            _, head_cols, head_offsets, head_mask = _row_block(tl.program_id(0), rows, width_head, 1, BLOCK_HEAD)
            head_values = tl.load(head + head_offsets, mask=head_mask, other=0.0).to(tl.float32)
            largest = tl.maximum(largest, tl.max(tl.where(head_mask, tl.abs(head_values), 0.0), axis=1))
        scale = tl.maximum(largest, scale_floor) * inverse_fp8_max
        tl.store(scales + row, scale, mask=row < rows)
        inverse = (1 / scale)[:, None]
        if HEAD:
            tl.store(out + out_row + head_cols[None, :],
                     tl.clamp(head_values * inverse, -fp8_max, fp8_max).to(out.dtype.element_ty), mask=head_mask)
        tl.store(out + out_row + width_head + cols[None, :],
                 tl.clamp(values * inverse, -fp8_max, fp8_max).to(out.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["rows"])
    def _rows_to_fp8_kernel(x, out, scales, rows, width, fp8_max, inverse_fp8_max, scale_floor, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr):
        """One program: ROWS rows of x [rows, K]."""
        row, cols, offsets, mask = _row_block(tl.program_id(0), rows, width, ROWS, BLOCK)
        values = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
        _store_rows(out, scales, row, rows, offsets, mask, values, fp8_max, inverse_fp8_max, scale_floor, True)
