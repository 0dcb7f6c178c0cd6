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
    batch, length, width = qkv.shape
    text_len = text_qkv.shape[1] if text_qkv is not None else 0
    heads = width // (3 * head_dim)
    q, k, v = (qkv.new_empty(batch, text_len + length, heads, head_dim) for _ in range(3))
    streams = [(qkv, q_weight, k_weight, text_len)]
    if text_len:
        streams.insert(0, (text_qkv, text_q_weight, text_k_weight, 0))
    cos, sin = cos.contiguous(), sin.contiguous()
    for source, q_w, k_w, first in streams:
        source = source.contiguous()
        tokens = source.shape[1]
        grid = (triton.cdiv(tokens, TOKENS_PER_PROGRAM), heads, batch)
        _qkv_kernel[grid](source, q_w, k_w, cos, sin, q, k, v, tokens, first, text_len + length, heads, eps,
                          HEAD_DIM=head_dim, TOKENS=TOKENS_PER_PROGRAM)
    return q, k, v


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
    @triton.jit(do_not_specialize=["tokens", "first", "joint_len"])
    def _qkv_kernel(source, q_weight, k_weight, cos, sin, q_out, k_out, v_out, tokens, first, joint_len, heads,
                    eps, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr):
        """One program: TOKENS tokens of one head of one sample of one stream; the stream's token t goes to
        joint position first + t."""
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
        out = ((sample * joint_len + position).to(tl.int64)[:, None] * heads + head) * HEAD_DIM + dim[None, :]
        out_dtype = q_out.dtype.element_ty
        x = tl.load(source + row, mask=mask, other=0.0).to(tl.float32)
        q = _norm_rotate(x, tl.load(q_weight + dim).to(tl.float32), cos_, sin_, eps, HEAD_DIM, TOKENS, out_dtype)
        tl.store(q_out + out, q.to(out_dtype), mask=mask)
        x = tl.load(source + row + heads * HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
        k = _norm_rotate(x, tl.load(k_weight + dim).to(tl.float32), cos_, sin_, eps, HEAD_DIM, TOKENS, out_dtype)
        tl.store(k_out + out, k.to(out_dtype), mask=mask)
        tl.store(v_out + out, tl.load(source + row + 2 * heads * HEAD_DIM, mask=mask), mask=mask)
