"""q, k and v of a FLUX attention from its fused q/k/v projections, in one pass on a GPU.

Each stream's fused projection gives [B, S, 3 * heads * head_dim]. The attention wants q and k RMS-normed per
head and rotary-embedded, and, in double blocks, the text stream's tokens before the image stream's, in one
sequence. Compiled by Inductor, that was a split, two norms, a concatenation per tensor and the rotary step:
~6 ms of every 4,096 + 512 token forward of FLUX.1-dev on an H200, its kernels moving about a third of what the
GPU's memory allows (docs/benchmarks.md). On CUDA, `joint_qkv` is one Triton kernel per stream that reads each
projection output once and writes q, k and v of the joint sequence in place; on CPU it is the same math in
PyTorch (a custom op either way, so torch.compile leaves it as it is).

The rounding is the eager path's: the norm in float32, rounded to the model's dtype, then the rotary step in
float32, rounded again.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from mdtriton.engine.attention.ulysses import pack_heads

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch: the PyTorch implementation serves
    triton = None

TOKENS_PER_PROGRAM = 16


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by cos and sin [S, D] (adjacent pairs), in float32, as diffusers does."""
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((-imag, real), dim=-1).flatten(3)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


def stream_qkv(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stream's q, k (normed, rotated) and v [B, S, H, D] from its projection output [B, S, 3 * H * D]."""
    head_dim = q_weight.shape[0]
    q, k, v = qkv.unflatten(-1, (3, -1, head_dim)).unbind(2)
    q = F.rms_norm(q, (head_dim,), q_weight, eps)
    k = F.rms_norm(k, (head_dim,), k_weight, eps)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


# (Optional, not "X | None", and no postponed annotations in this module: custom_op reads the schema from them.)
@torch.library.custom_op("mdtriton::joint_qkv", mutates_args=())
def joint_qkv(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, text_qkv: Optional[torch.Tensor],
              text_q_weight: Optional[torch.Tensor], text_k_weight: Optional[torch.Tensor], cos: torch.Tensor,
              sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v [B, S_text + S, H, D] (contiguous) of the joint sequence: the text stream's tokens (text_qkv, if
    given, normed with its own weights) first, then qkv's. cos and sin [S_text + S, D] are the rotary embedding
    of those tokens, in that order."""
    if qkv.is_cuda and triton is not None:
        return _joint_qkv_triton(qkv, q_weight, k_weight, text_qkv, text_q_weight, text_k_weight, cos, sin, eps)
    text_len = text_qkv.shape[1] if text_qkv is not None else 0
    parts = [stream_qkv(qkv, q_weight, k_weight, eps, cos[text_len:], sin[text_len:])]
    if text_qkv is not None:
        parts.insert(0, stream_qkv(text_qkv, text_q_weight, text_k_weight, eps, cos[:text_len], sin[:text_len]))
    return tuple(torch.cat(tensors, dim=1) for tensors in zip(*parts))


@joint_qkv.register_fake
def _(qkv, q_weight, k_weight, text_qkv, text_q_weight, text_k_weight, cos, sin, eps):
    head_dim = q_weight.shape[0]
    length = qkv.shape[1] + (text_qkv.shape[1] if text_qkv is not None else 0)
    shape = (qkv.shape[0], length, qkv.shape[2] // (3 * head_dim), head_dim)
    return tuple(qkv.new_empty(shape) for _ in range(3))


def _joint_qkv_triton(qkv, q_weight, k_weight, text_qkv, text_q_weight, text_k_weight, cos, sin, eps):
    head_dim = q_weight.shape[0]
    batch, _, width = qkv.shape
    heads = width // (3 * head_dim)
    q, k, v = (qkv.new_empty(batch, joint_length(qkv, text_qkv), heads, head_dim) for _ in range(3))
    _launch(qkv, q_weight, k_weight, text_qkv, text_q_weight, text_k_weight, cos, sin, eps, (q, k, v), 1)
    return q, k, v


def _launch(qkv, q_weight, k_weight, text_qkv, text_q_weight, text_k_weight, cos, sin, eps,
            outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], groups: int) -> None:
    """The kernel over both streams into outputs: q, k and v as views [B, S, groups, H / groups, D] (contiguous
    last dimension; the same strides for the three) of the joint sequence's tensors."""
    head_dim = q_weight.shape[0]
    batch, length, width = qkv.shape
    text_len = text_qkv.shape[1] if text_qkv is not None else 0
    heads = width // (3 * head_dim)
    q, k, v = (out.view(batch, text_len + length, groups, heads // groups, head_dim) if out.dim() == 4 else out
               for out in outputs)
    streams = [(qkv, q_weight, k_weight, text_len)]
    if text_len:
        streams.insert(0, (text_qkv, text_q_weight, text_k_weight, 0))
    cos, sin = cos.contiguous(), sin.contiguous()
    for source, q_w, k_w, first in streams:
        source = source.contiguous()
        tokens = source.shape[1]
        grid = (triton.cdiv(tokens, TOKENS_PER_PROGRAM), heads, batch)
        _qkv_kernel[grid](source, q_w, k_w, cos, sin, q, k, v, tokens, first, heads, heads // groups, q.stride(0),
                          q.stride(1), q.stride(2), eps, HEAD_DIM=head_dim, TOKENS=TOKENS_PER_PROGRAM)


def joint_length(qkv: torch.Tensor, text_qkv: torch.Tensor | None) -> int:
    return qkv.shape[1] + (text_qkv.shape[1] if text_qkv is not None else 0)


@torch.library.custom_op("mdtriton::packed_qkv", mutates_args=())
def packed_qkv(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, text_qkv: Optional[torch.Tensor],
               text_q_weight: Optional[torch.Tensor], text_k_weight: Optional[torch.Tensor], cos: torch.Tensor,
               sin: torch.Tensor, eps: float, ranks: int) -> torch.Tensor:
    """joint_qkv's q, k and v written as the Ulysses exchange of `ranks` ranks sends them
    (mdtriton.engine.attention.ulysses.pack_heads: [ranks, B, S_text + S, 3 * H / ranks, D]), so that it sends them
    with no copy."""
    if not (qkv.is_cuda and triton is not None):
        q, k, v = joint_qkv(qkv, q_weight, k_weight, text_qkv, text_q_weight, text_k_weight, cos, sin, eps)
        return pack_heads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ranks)
    head_dim = q_weight.shape[0]
    batch, heads = qkv.shape[0], qkv.shape[2] // (3 * head_dim)
    group = heads // ranks
    send = qkv.new_empty(ranks, batch, joint_length(qkv, text_qkv), 3 * group, head_dim)
    # [B, S, ranks, 3 * group, D] views of send, then q's, k's and v's heads of each group
    by_token = send.permute(1, 2, 0, 3, 4)
    outputs = tuple(by_token[..., index * group:(index + 1) * group, :] for index in range(3))
    _launch(qkv, q_weight, k_weight, text_qkv, text_q_weight, text_k_weight, cos, sin, eps, outputs, ranks)
    return send


@packed_qkv.register_fake
def _(qkv, q_weight, k_weight, text_qkv, text_q_weight, text_k_weight, cos, sin, eps, ranks):
    head_dim = q_weight.shape[0]
    heads = qkv.shape[2] // (3 * head_dim)
    return qkv.new_empty(ranks, qkv.shape[0], joint_length(qkv, text_qkv), 3 * heads // ranks, head_dim)


if triton is not None:
    @triton.jit
    def _norm_rotate(x, weight, cos, sin, eps, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr, out_dtype):
        """RMS norm of each row of x [TOKENS, HEAD_DIM] (float32) with weight, rounded to out_dtype, then rotated
        by cos and sin (adjacent pairs) in float32."""
        mean_square = tl.sum(x * x, axis=1) / HEAD_DIM
        normed = (x * tl.rsqrt(mean_square + eps)[:, None] * weight[None, :]).to(out_dtype).to(tl.float32)
        real, imag = tl.split(tl.reshape(normed, (TOKENS, HEAD_DIM // 2, 2)))
        rotated = tl.reshape(tl.join(-imag, real), (TOKENS, HEAD_DIM))
        return normed * cos + rotated * sin

    # Request sizes are not specialised on: no compile after the warm-up (see fused_activations).
    @triton.jit(do_not_specialize=["tokens", "first", "sample_stride"])
    def _qkv_kernel(source, q_weight, k_weight, cos, sin, q_out, k_out, v_out, tokens, first, heads, group_heads,
                    sample_stride, position_stride, group_stride, eps, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr):
        """One program: TOKENS tokens of one head of one sample of one stream; the stream's token t goes to
        joint position first + t. Head h is written as head h % group_heads of group h // group_heads: at
        sample * sample_stride + position * position_stride + group * group_stride + (h % group_heads) * HEAD_DIM."""
        block, head, sample = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        token = block * TOKENS + tl.arange(0, TOKENS)
        dim = tl.arange(0, HEAD_DIM)
        mask = (token < tokens)[:, None]
        width = 3 * heads * HEAD_DIM
        row = (sample * tokens + token).to(tl.int64)[:, None] * width + head * HEAD_DIM + dim[None, :]
        position = first + token
        angle = position.to(tl.int64)[:, None] * HEAD_DIM + dim[None, :]
        cos_ = tl.load(cos + angle, mask=mask, other=0.0)
        sin_ = tl.load(sin + angle, mask=mask, other=0.0)
        out = (sample.to(tl.int64) * sample_stride + position.to(tl.int64)[:, None] * position_stride
               + (head // group_heads).to(tl.int64) * group_stride + (head % group_heads) * HEAD_DIM + dim[None, :])
        out_dtype = q_out.dtype.element_ty
        x = tl.load(source + row, mask=mask, other=0.0).to(tl.float32)
        q = _norm_rotate(x, tl.load(q_weight + dim).to(tl.float32), cos_, sin_, eps, HEAD_DIM, TOKENS, out_dtype)
        tl.store(q_out + out, q.to(out_dtype), mask=mask)
        x = tl.load(source + row + heads * HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
        k = _norm_rotate(x, tl.load(k_weight + dim).to(tl.float32), cos_, sin_, eps, HEAD_DIM, TOKENS, out_dtype)
        tl.store(k_out + out, k.to(out_dtype), mask=mask)
        tl.store(v_out + out, tl.load(source + row + 2 * heads * HEAD_DIM, mask=mask), mask=mask)
