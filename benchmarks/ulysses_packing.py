"""What Ulysses' packing costs a Wan 2.1 14B block on one context-parallel rank, one GPU: the block's q/k norms and
rotary embedding as Inductor compiles them (symbolic sizes, deterministic), then q, k and v copied into the
exchange's send buffer (mdtriton.engine.attention.ulysses.pack_heads, PyTorch's strided copies); the same compiled
code writing the send buffer itself; and the hand-written kernels the engine runs (mdtriton.families.wan.qkv): q's and
k's heads normed and rotated in one kernel each (`wan_norm_rotate_heads`), and v's heads too (`wan_packed_heads`), in
the exchange's layout (with --ranks 1, [B, S, H, D], as every plan but Ulysses has them). The sums of squares come from
the compiled code in every row, as in the engine. Sizes: a rank's slice of 480p and 720p x 81 frames on 4 GPUs;
`--ranks 1 --tokens 32760,75600` is one GPU's whole sequence. (Inductor's code in the engine, between the GEMMs,
costs less than it does here alone: compare the forward's kernel times, docs/benchmarks.md session 22.)

    python benchmarks/ulysses_packing.py                       # one GPU
    python benchmarks/ulysses_packing.py --device cpu --tokens 64 --dim 256 --heads 4   # checks they agree
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mdtriton.engine.attention.ulysses import pack_heads
from mdtriton.families.wan.qkv import norm_rotate as wan_norm_rotate
from mdtriton.families.wan.qkv import norm_rotate_heads, packed_heads
from mdtriton.harness import device_name, markdown_table, time_calls

EPS = 1e-6


def norm_rotate(q, k, v, q_weight, k_weight, cos, sin, heads: int):
    """Wan's self-attention q, k, v [B, S, H, D] from its projections [B, S, dim] (tp 1): q and k RMS-normed over
    all heads, rotated (the engine's PyTorch implementation, compiled here by Inductor)."""
    head_dim = q.shape[-1] // heads
    q, k = (wan_norm_rotate(x, x.float().pow(2).sum(-1, keepdim=True), weight, x.shape[-1], EPS, cos, sin, head_dim)
            for x, weight in ((q, q_weight), (k, k_weight)))
    return q, k, v.unflatten(-1, (heads, -1))


def packed(q, k, v, q_weight, k_weight, cos, sin, heads: int, ranks: int):
    """norm_rotate's q, k and v written as pack_heads lays them out, in the compiled code."""
    q, k, v = norm_rotate(q, k, v, q_weight, k_weight, cos, sin, heads)
    batch, length, _, dim = q.shape
    return torch.cat([x.view(batch, length, ranks, heads // ranks, dim).permute(2, 0, 1, 3, 4) for x in (q, k, v)],
                     dim=3)


def squares_then_kernels(q, k, v, q_weight, k_weight, cos, sin, heads: int, ranks: int, with_v: bool):
    """The engine's path: sums of squares in the compiled code, then a kernel for each of q and k (and v)."""
    head_dim = q.shape[-1] // heads
    rotary = (cos, sin, q.shape[-1], EPS, head_dim, ranks)
    parts = [norm_rotate_heads(x, x.float().pow(2).sum(-1, keepdim=True), weight, *rotary)
             for x, weight in ((q, q_weight), (k, k_weight))]
    return parts + [packed_heads(v, head_dim, ranks)] if with_v else parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8190,18900", help="a rank's tokens (default: 480p and 720p x 81 on 4)")
    parser.add_argument("--dim", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    compiled_norm_rotate = torch.compile(norm_rotate, dynamic=True) if cuda else norm_rotate
    compiled_packed = torch.compile(packed, dynamic=True) if cuda else packed
    compiled_kernels = torch.compile(squares_then_kernels, dynamic=True) if cuda else squares_then_kernels
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        generator = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(1, tokens, args.dim, generator=generator, device=device).to(dtype) for _ in range(3))
        q_weight, k_weight = (1 + 0.1 * torch.randn(args.dim, generator=generator, device=device).to(dtype)
                              for _ in range(2))
        head_dim = args.dim // args.heads
        # Wan's tables: each pair of channels alike
        angles = torch.rand(tokens, head_dim // 2, generator=generator, device=device).repeat_interleave(2, 1) * 6.28
        cos, sin = angles.cos(), angles.sin()
        inputs = (q, k, v, q_weight, k_weight, cos, sin, args.heads)

        def copies():
            q_, k_, v_ = compiled_norm_rotate(*inputs)
            return pack_heads(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), args.ranks)

        with torch._inductor.config.patch(deterministic=True), torch.inference_mode():
            expected = copies()
            reference_q, reference_k, _ = compiled_norm_rotate(*inputs)
            differences = {
                "Inductor writing the send buffer": compiled_packed(*inputs, args.ranks) - expected,
                "the kernels' send buffers": torch.cat(compiled_kernels(*inputs, args.ranks, True), dim=3) - expected,
                "the kernels' q and k": torch.cat([a[0] - b for a, b in zip(compiled_kernels(*inputs, 1, False),
                                                                            (reference_q, reference_k))]),
            }
            results = {}
            for name, call in (("norm + rotary, then pack_heads' copies", copies),
                               ("norm + rotary only (no packing)", lambda: compiled_norm_rotate(*inputs)),
                               ("norm + rotary writing the send buffer", lambda: compiled_packed(*inputs, args.ranks)),
                               ("the kernels: q and k, [B, S, H, D]", lambda: compiled_kernels(*inputs, 1, False)),
                               ("the kernels: q, k and v in the exchange's layout",
                                lambda: compiled_kernels(*inputs, args.ranks, True))):
                results[name] = statistics.median(time_calls(call, cuda, 3, args.iterations)[0])
        for name, ms in results.items():
            rows.append([f"{tokens:,}", name, f"{ms:.3f}"])
        for name, difference in differences.items():
            print(f"{tokens:,} tokens: {name} differs from the compiled code's by at most "
                  f"{difference.float().abs().max().item():.2e}", flush=True)
    print(f"Wan block's q/k/v for a Ulysses exchange of {args.ranks} ranks ({device_name(device)}), median ms:\n")
    print(markdown_table(["a rank's tokens", "what", "ms"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
