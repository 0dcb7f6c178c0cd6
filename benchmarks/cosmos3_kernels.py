"""The kernels of a Cosmos 3 layer at its published width, 720p x 189 frames (44,160 vision rows attending 44,416
keys), one GPU, each alone, and the alternatives that could make the forward faster: FlashAttention-3 with its
grouped-query choices against cuDNN's attention; the residual add in the GEMM (cuBLAS's C input) or apart; SwiGLU in
the epilogue of an Inductor max-autotune GEMM; the query norm + rotary kernel as the engine compiles it and
autotuned. docs/benchmarks.md, session 21: none of them is a lever towards 0.9x diffusers + compile.

    python benchmarks/cosmos3_kernels.py          # a Hopper GPU with the fa3-fwd wheel
"""

import torch
import torch.nn.functional as F

from gemm_rows import time_ms  # this directory's: the same timing loop
from mdtriton.engine.attention.local import cudnn_sdpa
from mdtriton.families.cosmos3.layers import rms_norm, rotate

M, KEYS, HID, MLP = 44160, 44416, 4096, 12288


def attention_kernels(device: str) -> None:
    from fa3_fwd_interface import _flash_attn_forward as flash_attention
    q = torch.randn(1, M, 32, 128, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, KEYS, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    flops = 4 * M * KEYS * 128 * 32
    for pack in (None, True, False):
        ms = time_ms(lambda: flash_attention(q, k, v, softmax_scale=128 ** -0.5, pack_gqa=pack), 5)
        print(f"attention fa3 pack_gqa={pack}: {ms:.2f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    k32, v32 = k.repeat_interleave(4, 2), v.repeat_interleave(4, 2)
    ms = time_ms(lambda: flash_attention(q, k32, v32, softmax_scale=128 ** -0.5), 5)
    print(f"attention fa3 kv expanded to 32 heads: {ms:.2f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    ms = time_ms(lambda: cudnn_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), 5)
    print(f"attention cudnn: {ms:.2f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


def residual_gemms(device: str) -> None:
    x, o = (torch.randn(M, HID, device=device, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(HID, HID, device=device, dtype=torch.bfloat16) * 0.02
    print(f"out + residual: x + linear(o) {time_ms(lambda: x + F.linear(o, w)):.3f} ms, "
          f"addmm(x, o, w.t()) {time_ms(lambda: torch.addmm(x, o, w.t())):.3f}, "
          f"linear alone {time_ms(lambda: F.linear(o, w)):.3f}", flush=True)
    compiled = torch.compile(lambda x, o: x + F.linear(o, w), dynamic=True)
    with torch._inductor.config.patch(deterministic=True):
        print(f"out + residual compiled as the engine compiles: {time_ms(lambda: compiled(x, o)):.3f} ms", flush=True)
    h = torch.randn(M, MLP, device=device, dtype=torch.bfloat16)
    w_down = torch.randn(HID, MLP, device=device, dtype=torch.bfloat16) * 0.02
    print(f"down + residual: x + linear(h) {time_ms(lambda: x + F.linear(h, w_down)):.3f} ms, "
          f"addmm {time_ms(lambda: torch.addmm(x, h, w_down.t())):.3f}", flush=True)


def swiglu_gemm(device: str) -> None:
    x = torch.randn(M, HID, device=device, dtype=torch.bfloat16)
    w_gate_up = torch.randn(2 * MLP, HID, device=device, dtype=torch.bfloat16) * 0.02

    def swiglu(x):
        gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
        return F.silu(gate) * up

    ms = time_ms(lambda: F.linear(x, w_gate_up), 5)
    print(f"gate/up GEMM alone: {ms:.3f} ms {2 * M * 2 * MLP * HID / ms / 1e9:.0f} TFLOP/s", flush=True)
    compiled = torch.compile(swiglu, dynamic=True)
    with torch._inductor.config.patch(deterministic=True):
        print(f"SwiGLU as the engine compiles it: {time_ms(lambda: compiled(x), 5):.3f} ms", flush=True)
    tuned = torch.compile(swiglu, mode="max-autotune-no-cudagraphs", dynamic=False)
    print(f"SwiGLU max-autotune: {time_ms(lambda: tuned(x), 5):.3f} ms", flush=True)


def query_norm_rotary(device: str) -> None:
    qkv = torch.randn(1, M, 6144, device=device, dtype=torch.bfloat16)
    weight = torch.randn(128, device=device, dtype=torch.bfloat16)
    cos, sin = (torch.randn(M, 128, device=device, dtype=torch.bfloat16) for _ in range(2))

    def norm_rotate(qkv):
        return rotate(rms_norm(qkv[..., :4096].unflatten(-1, (32, 128)), weight, 1e-6, False), cos, sin)

    compiled = torch.compile(norm_rotate, dynamic=True)
    with torch._inductor.config.patch(deterministic=True):
        print(f"query norm + rotary as the engine compiles it: {time_ms(lambda: compiled(qkv)):.3f} ms", flush=True)
    torch._dynamo.reset()
    tuned = torch.compile(norm_rotate, mode="max-autotune-no-cudagraphs", dynamic=False)
    print(f"query norm + rotary, max-autotune: {time_ms(lambda: tuned(qkv)):.3f} ms", flush=True)


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for part in (attention_kernels, residual_gemms, swiglu_gemm, query_norm_rotary):
        part("cuda")


if __name__ == "__main__":
    main()
