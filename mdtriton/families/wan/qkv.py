"""q, k and v of a Wan self-attention from its three projections, in one pass on a GPU.

Wan RMS-normalises q and k across all heads (from each token's sum of squares over every tensor-parallel rank's
columns: layers.sums_of_squares), then rotates them per head (rotary embedding over frames, rows and columns).
Compiled by Inductor that pass ran at about a quarter of what the GPU's memory allows, and for Ulysses q, k and v were
then copied into the exchange's send buffer (docs/benchmarks.md). On CUDA one Triton kernel reads each projection
output once and writes q and k normed and rotated, either as two [B, S, H, D] tensors (`qk`) or, with v, straight into
Ulysses' send buffer (`packed_qkv`: ulysses.pack_heads' layout, so the exchange sends it with no copy). On CPU both
are the same math in PyTorch (custom ops either way, so torch.compile leaves them as they are).

The rounding is the eager path's: the norm in float32, rounded to the model's dtype, times the weight (rounded
again), then the rotary step in float32, rounded once more.
"""

import torch

from mdtriton.engine.attention.ulysses import pack_heads
from mdtriton.engine.layers import rms_norm_of_squares

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch: the PyTorch implementation serves
    triton = None

TOKENS_PER_PROGRAM = 16


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


@torch.library.custom_op("mdtriton::wan_qk", mutates_args=())
def qk(q: torch.Tensor, k: torch.Tensor, q_squares: torch.Tensor, k_squares: torch.Tensor, q_weight: torch.Tensor,
       k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, features: int, eps: float,
       head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [B, S, H, D] (contiguous) from their projections [B, S, H * D]: normed by the sums of squares
    [B, S, 1] (float32) over all `features`, times the weight, rotated by cos and sin [S, D]."""
    if not (q.is_cuda and triton is not None):
        return (norm_rotate(q, q_squares, q_weight, features, eps, cos, sin, head_dim),
                norm_rotate(k, k_squares, k_weight, features, eps, cos, sin, head_dim))
    outputs = tuple(x.new_empty(*x.shape[:2], x.shape[2] // head_dim, head_dim) for x in (q, k))
    _launch(q, k, None, q_squares, k_squares, q_weight, k_weight, cos, sin, features, eps, outputs, 1)
    return outputs


@qk.register_fake
def _(q, k, q_squares, k_squares, q_weight, k_weight, cos, sin, features, eps, head_dim):
    return tuple(x.new_empty(*x.shape[:2], x.shape[2] // head_dim, head_dim) for x in (q, k))


@torch.library.custom_op("mdtriton::wan_packed_qkv", mutates_args=())
def packed_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_squares: torch.Tensor, k_squares: torch.Tensor,
               q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, features: int,
               eps: float, head_dim: int, ranks: int) -> torch.Tensor:
    """qk's q and k, and v, written as the Ulysses exchange of `ranks` ranks sends them
    (mdtriton.engine.attention.ulysses.pack_heads: [ranks, B, S, 3 * H / ranks, D]), so that it sends them with
    no copy."""
    if not (q.is_cuda and triton is not None):
        q, k = qk(q, k, q_squares, k_squares, q_weight, k_weight, cos, sin, features, eps, head_dim)
        v = v.unflatten(-1, (-1, head_dim))
        return pack_heads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ranks)
    batch, length, width = q.shape
    group = width // head_dim // ranks
    send = q.new_empty(ranks, batch, length, 3 * group, head_dim)
    # [B, S, ranks, 3 * group, D] views of send, then q's, k's and v's heads of each group
    by_token = send.permute(1, 2, 0, 3, 4)
    outputs = tuple(by_token[..., index * group:(index + 1) * group, :] for index in range(3))
    _launch(q, k, v, q_squares, k_squares, q_weight, k_weight, cos, sin, features, eps, outputs, ranks)
    return send


@packed_qkv.register_fake
def _(q, k, v, q_squares, k_squares, q_weight, k_weight, cos, sin, features, eps, head_dim, ranks):
    batch, length, width = q.shape
    return q.new_empty(ranks, batch, length, 3 * width // head_dim // ranks, head_dim)


def _launch(q, k, v, q_squares, k_squares, q_weight, k_weight, cos, sin, features, eps,
            outputs: tuple[torch.Tensor, ...], groups: int) -> None:
    """The kernel into outputs: q, k (and v, if given) as views [B, S, groups, H / groups, D] or [B, S, H, D]
    (contiguous last dimension; the same strides for all) of what it writes."""
    head_dim = outputs[0].shape[-1]
    batch, tokens, width = q.shape
    heads = width // head_dim
    outputs = [out.view(batch, tokens, groups, heads // groups, head_dim) if out.dim() == 4 else out
               for out in outputs]
    q_out, k_out = outputs[:2]
    v_out = outputs[2] if v is not None else q_out
    q, k = q.contiguous(), k.contiguous()
    v = v.contiguous() if v is not None else q
    grid = (triton.cdiv(tokens, TOKENS_PER_PROGRAM), heads, batch)
    _kernel[grid](q, k, v, q_squares.contiguous(), k_squares.contiguous(), q_weight, k_weight, cos.contiguous(),
                  sin.contiguous(), q_out, k_out, v_out, tokens, heads, heads // groups, q_out.stride(0),
                  q_out.stride(1), q_out.stride(2), 1.0 / features, eps, HEAD_DIM=head_dim,
                  TOKENS=TOKENS_PER_PROGRAM, COPY_V=v is not q)


if triton is not None:
    @triton.jit
    def _norm_rotate(x, squares, weight, cos, sin, inverse_features, eps, HEAD_DIM: tl.constexpr,
                     TOKENS: tl.constexpr, out_dtype):
        """x [TOKENS, HEAD_DIM] (float32) normed by its rows' sums of squares [TOKENS], rounded to out_dtype, times
        the weight (rounded again), then rotated by cos and sin (adjacent pairs) in float32."""
        normed = (x * tl.rsqrt(squares * inverse_features + eps)[:, None]).to(out_dtype).to(tl.float32)
        weighted = (normed * weight[None, :]).to(out_dtype).to(tl.float32)
        real, imag = tl.split(tl.reshape(weighted, (TOKENS, HEAD_DIM // 2, 2)))
        rotated = tl.reshape(tl.join(-imag, real), (TOKENS, HEAD_DIM))
        return weighted * cos + rotated * sin

    # Request sizes are not specialised on: no compile after the warm-up (see fused_activations).
    @triton.jit(do_not_specialize=["tokens", "sample_stride"])
    def _kernel(q, k, v, q_squares, k_squares, q_weight, k_weight, cos, sin, q_out, k_out, v_out, tokens, heads,
                group_heads, sample_stride, position_stride, group_stride, inverse_features, eps,
                HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr, COPY_V: tl.constexpr):
        """One program: TOKENS tokens of one head of one sample. Head h is written as head h % group_heads of group
        h // group_heads: at sample * sample_stride + token * position_stride + group * group_stride
        + (h % group_heads) * HEAD_DIM."""
        block, head, sample = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        token = block * TOKENS + tl.arange(0, TOKENS)
        dim = tl.arange(0, HEAD_DIM)
        valid = token < tokens
        mask = valid[:, None]
        row = (sample * tokens + token).to(tl.int64)
        source = row[:, None] * (heads * HEAD_DIM) + head * HEAD_DIM + dim[None, :]
        angle = token.to(tl.int64)[:, None] * HEAD_DIM + dim[None, :]
        cos_ = tl.load(cos + angle, mask=mask, other=0.0)
        sin_ = tl.load(sin + angle, mask=mask, other=0.0)
        out = (sample.to(tl.int64) * sample_stride + token.to(tl.int64)[:, None] * position_stride
               + (head // group_heads).to(tl.int64) * group_stride + (head % group_heads) * HEAD_DIM + dim[None, :])
        out_dtype = q_out.dtype.element_ty
        x = tl.load(q + source, mask=mask, other=0.0).to(tl.float32)
        weight = tl.load(q_weight + head * HEAD_DIM + dim).to(out_dtype).to(tl.float32)
        squares = tl.load(q_squares + row, mask=valid, other=1.0)
        result = _norm_rotate(x, squares, weight, cos_, sin_, inverse_features, eps, HEAD_DIM, TOKENS, out_dtype)
        tl.store(q_out + out, result.to(out_dtype), mask=mask)
        x = tl.load(k + source, mask=mask, other=0.0).to(tl.float32)
        weight = tl.load(k_weight + head * HEAD_DIM + dim).to(out_dtype).to(tl.float32)
        squares = tl.load(k_squares + row, mask=valid, other=1.0)
        result = _norm_rotate(x, squares, weight, cos_, sin_, inverse_features, eps, HEAD_DIM, TOKENS, out_dtype)
        tl.store(k_out + out, result.to(out_dtype), mask=mask)
        if COPY_V:
            tl.store(v_out + out, tl.load(v + source, mask=mask), mask=mask)
