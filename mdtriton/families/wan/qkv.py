"""The heads of a Wan self-attention's q, k and v from its three projections, each in one pass on a GPU, laid out
as Ulysses' exchange sends them.

Wan RMS-normalises q and k across all heads (from each token's sum of squares over every tensor-parallel rank's
columns: layers.sums_of_squares), then rotates them per head (rotary embedding over frames, rows and columns). For
Ulysses each of q, k and v is then sent in the exchange's layout (ulysses.pack_heads': [ranks, B, S, H / ranks, D]),
where Inductor's code needed a copy more (docs/benchmarks.md). On CUDA one Triton kernel reads a projection's output
once and writes its heads in that layout, normed and rotated (`norm_rotate_heads`: q and k) or as they are
(`packed_heads`: v); with one rank the layout is [B, S, H, D]. On CPU both are the same math in PyTorch (custom ops
either way, so torch.compile leaves them as they are).

The rounding is the eager path's: the norm in float32, rounded to the model's dtype, times the weight (rounded
again), then the rotary step in float32, rounded once more.
"""

import torch

from mdtriton.engine.attention.ulysses import heads_by_rank
from mdtriton.engine.layers import rms_norm_of_squares

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch: the PyTorch implementation serves
    triton = None

TOKENS_PER_PROGRAM = 16
WARPS = 4


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, S, H, D] by cos/sin [S, D] (pairs interleaved), as diffusers' Wan processor."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, 0::2], sin[None, :, None, 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


def norm_rotate(x: torch.Tensor, squares: torch.Tensor, weight: torch.Tensor, features: int, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x [B, S, local features] normed by its rows' sums of squares over all `features` [B, S, 1], split in heads
    [B, S, H, D] and rotated: what the kernel computes, in PyTorch."""
    normed = rms_norm_of_squares(x, squares, weight, features, eps)
    return rotate(normed.unflatten(-1, (-1, head_dim)), cos, sin)


@torch.library.custom_op("mdtriton::wan_norm_rotate_heads", mutates_args=())
def norm_rotate_heads(x: torch.Tensor, squares: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, features: int, eps: float, head_dim: int, ranks: int) -> torch.Tensor:
    """x [B, S, H * D] (q or k) normed by its rows' sums of squares [B, S, 1] (float32) over all `features`, times
    the weight, rotated by cos and sin [S, D] (each pair of channels alike, as Wan.rotary makes them): its heads as
    the Ulysses exchange of `ranks` ranks sends them, [ranks, B, S, H / ranks, D]."""
    if not (x.is_cuda and triton is not None):
        return heads_by_rank(norm_rotate(x, squares, weight, features, eps, cos, sin, head_dim), ranks)
    return _launch(x, (squares, weight, cos, sin, 1.0 / features, eps), head_dim, ranks)


@norm_rotate_heads.register_fake
def _(x, squares, weight, cos, sin, features, eps, head_dim, ranks):
    return _empty_heads(x, head_dim, ranks)


@torch.library.custom_op("mdtriton::wan_packed_heads", mutates_args=())
def packed_heads(x: torch.Tensor, head_dim: int, ranks: int) -> torch.Tensor:
    """x [B, S, H * D] (v): its heads as the Ulysses exchange of `ranks` ranks sends them, [ranks, B, S, H / ranks,
    D]."""
    if not (x.is_cuda and triton is not None):
        return heads_by_rank(x.unflatten(-1, (-1, head_dim)), ranks)
    return _launch(x, None, head_dim, ranks)


@packed_heads.register_fake
def _(x, head_dim, ranks):
    return _empty_heads(x, head_dim, ranks)


def _empty_heads(x: torch.Tensor, head_dim: int, ranks: int) -> torch.Tensor:
    batch, length, width = x.shape
    return x.new_empty(ranks, batch, length, width // head_dim // ranks, head_dim)


def _launch(x: torch.Tensor, norm: tuple | None, head_dim: int, ranks: int) -> torch.Tensor:
    """The kernel over x's heads into a new [ranks, B, S, H / ranks, D] tensor; norm: (squares, weight, cos, sin,
    1 / features, eps), or None to copy the heads as they are."""
    out = _empty_heads(x, head_dim, ranks)
    batch, tokens, width = x.shape
    heads = width // head_dim
    x = x.contiguous()
    squares, weight, cos, sin, inverse_features, eps = norm if norm is not None else (x, x, x, x, 1.0, 0.0)
    by_token = out.permute(1, 2, 0, 3, 4)  # [B, S, ranks, H / ranks, D]
    # Heads first: the programs running together share their tokens' cos and sin in the L2 cache (the tables of a
    # one-GPU 720p clip, 77 MB, do not fit it).
    grid = (heads, triton.cdiv(tokens, TOKENS_PER_PROGRAM), batch)
    _kernel[grid](x, squares.contiguous(), weight, cos.contiguous(), sin.contiguous(), out, tokens, heads,
                  heads // ranks, by_token.stride(0), by_token.stride(1), by_token.stride(2), inverse_features, eps,
                  HEAD_DIM=head_dim, BLOCK_DIM=triton.next_power_of_2(head_dim), TOKENS=TOKENS_PER_PROGRAM,
                  NORM=norm is not None, num_warps=WARPS)
    return out


if triton is not None:
    # Request sizes are not specialised on: no compile after the warm-up (see fused_activations).
    @triton.jit(do_not_specialize=["tokens", "sample_stride", "group_stride"])
    def _kernel(x, squares, weight, cos, sin, out, tokens, heads, group_heads, sample_stride, position_stride,
                group_stride, inverse_features, eps, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
                TOKENS: tl.constexpr, NORM: tl.constexpr):
        """One program: TOKENS tokens of one head of one sample. Head h is written as head h % group_heads of group
        h // group_heads: at sample * sample_stride + token * position_stride + group * group_stride
        + (h % group_heads) * HEAD_DIM. With NORM the head is normed by its row's sum of squares, rounded to the
        output's type, times the weight (rounded again), then rotated by cos and sin (adjacent pairs) in float32."""
        head, block, sample = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        token = block * TOKENS + tl.arange(0, TOKENS)
        dim = tl.arange(0, BLOCK_DIM)
        valid = token < tokens
        in_head = dim < HEAD_DIM
        mask = valid[:, None] & in_head[None, :]
        row = (sample * tokens + token).to(tl.int64)
        source = row[:, None] * (heads * HEAD_DIM) + head * HEAD_DIM + dim[None, :]
        target = (sample.to(tl.int64) * sample_stride + token.to(tl.int64)[:, None] * position_stride
                  + (head // group_heads).to(tl.int64) * group_stride + (head % group_heads) * HEAD_DIM + dim[None, :])
        if NORM:
            out_dtype = out.dtype.element_ty
            angle = token.to(tl.int64)[:, None] * HEAD_DIM + dim[None, :]
            cos_ = tl.load(cos + angle, mask=mask, other=0.0)
            sin_ = tl.load(sin + angle, mask=mask, other=0.0)
            values = tl.load(x + source, mask=mask, other=0.0).to(tl.float32)
            scale = tl.rsqrt(tl.load(squares + row, mask=valid, other=1.0) * inverse_features + eps)
            normed = (values * scale[:, None]).to(out_dtype).to(tl.float32)
            head_weight = tl.load(weight + head * HEAD_DIM + dim, mask=in_head, other=0.0).to(out_dtype)
            weighted = (normed * head_weight.to(tl.float32)[None, :]).to(out_dtype).to(tl.float32)
            real, imag = tl.split(tl.reshape(weighted, (TOKENS, BLOCK_DIM // 2, 2)))
            rotated = tl.reshape(tl.join(-imag, real), (TOKENS, BLOCK_DIM))
            tl.store(out + target, (weighted * cos_ + rotated * sin_).to(out_dtype), mask=mask)
        else:
            tl.store(out + target, tl.load(x + source, mask=mask), mask=mask)
