"""Attention over keys held on this rank: the plain case and the building blocks of the CP methods."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mdtriton.engine.attention import fa3
from mdtriton.engine.comm import Communicator

# Where FlashAttention-3 is available (Hopper, the fa3-fwd wheel) it runs bf16 attention instead of SDPA: faster on
# an H200 at every FLUX length (docs/benchmarks.md). Otherwise SDPA's kernels, fastest first: on Hopper, cuDNN's
# attention runs FLUX's shapes (128-wide heads, bf16) at about twice the rate of torch's flash attention; the others
# are fallbacks for what cuDNN does not take.
KERNEL_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]
# The kernels that return the log-sum-exp the ring method needs take these dtypes on CUDA.
LSE_KERNEL_DTYPES = (torch.float16, torch.bfloat16)

# Work beside the attention (the package's docstring): a function of no arguments, or None.
Beside = Callable[[], Any] | None
# Work on beside's result, beside the transfer of the attention's output (the packed attention of Ulysses' methods).
After = Callable[[Any], Any] | None
# Multiprocessors that the GEMMs and FlashAttention-3 beside a transfer leave to NCCL's kernels. cuBLAS's Hopper GEMMs
# and FlashAttention-3 run persistent grids that otherwise take every multiprocessor, and the transfer's kernel starts
# only once they end (or the attention's last programs wait for the transfer's). On 2 H200s at FLUX's 4,096+512
# tokens, 8 made the forward 2% faster (ring and Ulysses; the GEMMs' carve-out), 24 no faster than 8; the ring's
# attention with 8 left, 2% faster again, with 16 no faster than with 8 (docs/benchmarks.md). allgather_kv's now; the
# ring and Ulysses leave more (below).
NCCL_SMS = 8
# The ring's GEMMs and attention beside its transfers leave more: on 4 ranks a step sends to both neighbours. On 4
# H200s 16 made ring 4 7% faster than 8 at FLUX's 4,096+512 tokens and 6% at 16,384+512, though at 16k a margin of 16
# adds a round to FlashAttention-3's grid (16 for the GEMMs alone: 4% at 16k). On 2 H200s 16 was within 1% of 8
# (docs/benchmarks.md).
RING_NCCL_SMS = 16
# The GEMMs beside Ulysses' all-to-all leave more: NCCL's all-to-all kernel runs 32 CTAs, at most two to a
# multiprocessor, and the transfer ends only once all have run. On 4 H200s 24 made ulysses 4 at 4,096+512 tokens 5%
# faster than 8 (the exposed transfers halved), and left 16,384+512 tokens as it was (docs/benchmarks.md).
ALL_TO_ALL_NCCL_SMS = 24


def uses_fa3(q: torch.Tensor) -> bool:
    """Whether attention of q (and keys and values like it) runs FlashAttention-3."""
    return q.dtype == torch.bfloat16 and q.is_cuda and fa3_available(q.device.index)


@functools.cache
def fa3_available(device_index: int) -> bool:
    return fa3.available(torch.device("cuda", device_index))


def expand_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with as many heads as q: each key/value head repeated for the query heads that share it
    (grouped-query attention: query head h uses key/value head h // (q heads / key/value heads))."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def beside_transfer(beside: Beside, device: torch.device, nccl_sms: int) -> Any:
    """beside(), called while a transfer is in flight: on a GPU its cuBLASLt GEMMs leave nccl_sms multiprocessors
    free (the method's: NCCL_SMS, RING_NCCL_SMS or ALL_TO_ALL_NCCL_SMS), so that the transfer runs beside them."""
    if beside is None:
        return None
    if device.type != "cuda":
        return beside()
    previous = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(nccl_sms)
    try:
        return beside()
    finally:
        torch._C._set_sm_carveout_experimental(previous)


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention [B, H, S, D] of q over all of k and v (which may have fewer heads: expand_heads): FlashAttention-3
    where available (uses_fa3; it shares key/value heads itself), else scaled_dot_product_attention with the kernels
    tried in KERNEL_PRIORITY order, on key/value heads repeated (cuDNN's kernel takes no grouped heads, and SDPA's
    enable_gqa would fall back to the slower flash kernel)."""
    if uses_fa3(q):
        return fa3.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    k, v = expand_heads(q, k, v)
    with sdpa_kernel(KERNEL_PRIORITY, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v)


@torch._disable_dynamo
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, valid_len: int,
              beside: Beside = None):
    """Attention when this rank holds the whole sequence (cp_size 1); keys from valid_len on are dropped."""
    out = plain_attention(q, k[:, :, :valid_len], v[:, :, :valid_len])
    return out if beside is None else (out, beside())


def cudnn_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's cuDNN attention [B, H, S, D] alone (fewer key/value heads repeated for it, as plain_attention does):
    the rate benchmarks hold the engine's attention against. On CPU, which has no cuDNN, torch's SDPA as it chooses,
    so that the benchmarks' CPU checks run."""
    k, v = expand_heads(q, k, v)
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
                       nccl_sms: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [B, H, Sq, D] and the log-sum-exp of each query's scaled scores [B, H, Sq] (float32); k and v
    may have fewer heads than q (expand_heads). out: contiguous [B, Sq, H, D] memory the output is written to (and
    returned a view of), else new. nccl_sms: multiprocessors the kernel leaves to NCCL, where a transfer runs beside
    it (FlashAttention-3 only; its persistent grid would otherwise take them, and the transfer wait).

    On CUDA in fp16/bf16 this is one kernel: FlashAttention-3 where available, else cuDNN's (flash attention where
    cuDNN refuses the shape); elsewhere it is computed explicitly in float32.
    """
    if uses_fa3(q):
        result, lse = fa3.attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out=out,
                                             sm_margin=nccl_sms)
        return result.transpose(1, 2), lse
    k, v = expand_heads(q, k, v)
    if q.device.type == "cuda" and q.dtype in LSE_KERNEL_DTYPES:
        try:
            result, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
        except RuntimeError:
            result, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
        lse = lse.reshape(result.shape[:-1])
    else:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        lse = scores.logsumexp(dim=-1)
        result = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    if out is None:
        return result, lse
    out.copy_(result.transpose(1, 2))
    return out.transpose(1, 2), lse
