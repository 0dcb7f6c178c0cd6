"""One attention call at FLUX.1-dev's shapes (batch 1, 24 heads of 128) by each kernel on this GPU: torch's
cuDNN SDPA (what the engine ran until 2026-11-24), FlashAttention-3 in bf16 and FlashAttention-3 in FP8 (the
`fa3-fwd` wheel, Hopper), timed by the benchmark harness (mdtriton/harness.py: CUDA events, the median after 3
warm-up calls), and each one's error against float32 attention.

The error inputs are q, k and v as the engine makes them: q and k RMS-normed per head (then scaled, since
trained norm weights are not all ones: --qk-scale), v as a projection gives it. FP8 attention takes q, k and v in
e4m3 with one scale per sample and head (FlashAttention-3's descales), timed with and without that quantization.

    python benchmarks/attention_kernels.py --tokens 4608,16896,66048
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mdtriton.engine.attention import fa3
from mdtriton.engine.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR
from mdtriton.harness import markdown_table, relative_error, time_calls, timing

HEADS, HEAD_DIM = 24, 128


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """float32 attention [B, S, H, D] of [B, S, H, D] inputs, a chunk of queries at a time."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    out = torch.cat([torch.softmax(q[:, :, i:i + chunk] @ k.transpose(-1, -2) * HEAD_DIM ** -0.5, dim=-1) @ v
                     for i in range(0, q.shape[2], chunk)], dim=2)
    return out.transpose(1, 2)


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, S, H, D] -> (e4m3 values, float32 descale [B, H]): x ~= values * descale, a scale per sample and head."""
    scale = x.abs().amax(dim=(1, 3)).float().clamp(min=SCALE_FLOOR) / FP8_MAX
    return (x.float() / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(q, k, v in e4m3, their descales) for fa3.attention(..., descales)."""
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = (quantize_heads(t) for t in (q, k, v))
    return q8, k8, v8, (q_scale, k_scale, v_scale)


def engine_like_inputs(tokens: int, qk_scale: float, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    shape = (1, tokens, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=generator, device="cuda") for _ in range(3))
    q, k = (F.rms_norm(t, (HEAD_DIM,)) * qk_scale for t in (q, k))
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def prepared(prepare, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    return (q, k, v) if prepare is None else prepare(q, k, v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4608,16896,66048", help="joint sequence lengths, comma-separated")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--qk-scale", type=float, default=2.0, help="scale of the RMS-normed q and k (see above)")
    parser.add_argument("--error-tokens", type=int, default=4608, help="length at which errors are measured")
    args = parser.parse_args()
    # name: (prepare the inputs, untimed; the kernel)
    kernels = {"cuDNN SDPA (bf16)": (None, cudnn)}
    if fa3.available(torch.device("cuda")):
        kernels["FA3 bf16"] = (None, fa3.attention)
        kernels["FA3 FP8 (kernel)"] = (quantize_qkv, fa3.attention)
        kernels["FA3 FP8 + quantize"] = (None, lambda q, k, v: fa3.attention(*quantize_qkv(q, k, v)))
    else:
        print(f"FlashAttention-3 not usable here: {fa3.unavailable_reason(torch.device('cuda'))}")
    generator = torch.Generator("cuda").manual_seed(0)
    q, k, v = engine_like_inputs(args.error_tokens, args.qk_scale, generator)
    expected = reference(q, k, v)
    errors = {name: relative_error(kernel(*prepared(prepare, q, k, v)), expected)
              for name, (prepare, kernel) in kernels.items()}
    print(f"{torch.cuda.get_device_name()}, batch 1, {HEADS} heads x {HEAD_DIM}; error vs float32 at "
          f"{args.error_tokens:,} tokens (q, k RMS-normed x {args.qk_scale})\n")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        q, k, v = engine_like_inputs(tokens, args.qk_scale, generator)
        flops = 4 * tokens * tokens * HEADS * HEAD_DIM
        base = None
        for name, (prepare, kernel) in kernels.items():
            inputs = prepared(prepare, q, k, v)
            ms = timing(time_calls(lambda: kernel(*inputs), True, 3, args.iterations)[0])["median_ms"]
            base = base or ms
            rows.append([f"{tokens:,}", name, f"{ms:.3f}", f"{flops / ms / 1e9:.0f}", f"{base / ms:.2f}x",
                         f"{errors[name]:.1e}"])
    print(markdown_table(["tokens", "kernel", "median ms", "TFLOP/s", "vs cuDNN", "rel. error vs float32"], rows))


if __name__ == "__main__":
    main()
