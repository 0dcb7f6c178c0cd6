"""FlashAttention-3 (Hopper) for the engine's attention, in bf16, from the `fa3-fwd` wheel (the
forward kernels of FlashAttention-3, built for CUDA 13 against torch's stable ABI: `pip install mdtriton[hopper]`).

On an H200 it runs FLUX's attention faster than torch's cuDNN SDPA (docs/benchmarks.md), takes q, k and v in
the [batch, tokens, heads, head_dim] layout the q/k/v kernel writes (no transposes), and returns the
log-sum-exp that ring attention needs. Where the wheel is missing or the GPU is not a Hopper, `available` says
no and the engine keeps cuDNN's SDPA. Its FP8 kernel is not used (its error: docs/architecture.md).
"""

from __future__ import annotations

import torch

try:
    import fa3_fwd_interface  # registers torch.ops.fa3_fwd
    IMPORT_ERROR = None
except (ImportError, OSError) as error:  # not installed, or its library does not load with this torch
    fa3_fwd_interface = None
    IMPORT_ERROR = error

# FlashAttention-3's kernels are Hopper's (wgmma, TMA).
CAPABILITY = (9, 0)


def unavailable_reason(device: torch.device) -> str | None:
    """Why FlashAttention-3 cannot run on device, or None if it can."""
    if device.type != "cuda":
        return f"it runs on CUDA GPUs, not on {device.type}"
    if fa3_fwd_interface is None:
        return f"the fa3-fwd wheel is not importable ({IMPORT_ERROR}); pip install 'mdtriton[hopper]'"
    capability = torch.cuda.get_device_capability(device)
    if capability != CAPABILITY:
        return f"its kernels are for compute capability 9.0 (Hopper); this GPU is {capability[0]}.{capability[1]}"
    return None


def available(device: torch.device) -> bool:
    return unavailable_reason(device) is None


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
                       sm_margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [B, Sq, H, D] (bf16) of q [B, Sq, H, D] over k, v [B, Sk, H, D], and the log-sum-exp of
    each query's scaled scores [B, H, Sq] (float32). out: where to write the output (contiguous [B, Sq, H, D]), else
    a new tensor. sm_margin: multiprocessors the kernel leaves free (its persistent grid is that much smaller), for a
    transfer that runs beside it."""
    # The kernel's own op (not the wrapper's custom op, which declares that it writes no input).
    out, lse, *_ = torch.ops.fa3_fwd.fwd(q, k, v, out=out, softmax_scale=q.shape[-1] ** -0.5, num_splits=1,
                                         sm_margin=sm_margin)
    return out, lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention output [B, Sq, H, D] (see attention_with_lse)."""
    return attention_with_lse(q, k, v)[0]
