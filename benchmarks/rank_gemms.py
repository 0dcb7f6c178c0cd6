"""Whether the context-parallel rank that holds the text tokens is the slow one in FLUX's double blocks, and whether
one grouped GEMM would even it out.

Context parallelism splits the joint [text; image] sequence into contiguous slices, so at 1024x1024 (512 text + 4,096
image tokens) on 4 ranks rank 0 holds the 512 text and 640 image tokens and each other rank 1,152 image tokens. A
double block runs each stream through weights of its own, so rank 0 runs each of its GEMMs as two (M = 512 and 640)
where the others run one (M = 1,152). Two GEMMs of fewer rows each may take longer than one of their rows together
(each fills its last wave of tiles alone), and every other rank then waits for rank 0 in the next exchange. For each
GEMM of a double block (FLUX.1-dev's width: q/k/v fused, the attention output, the feed-forward's two layers), bf16,
one GPU: one GEMM of a whole slice's rows, rank 0's two GEMMs, and rank 0's two as one grouped GEMM (torch._grouped_mm,
the text and image weights stacked), each the median of --iterations timed calls of 20 GEMMs, per GEMM.

    python benchmarks/rank_gemms.py                                            # 1024x1024 on 2 and 4 ranks
    python benchmarks/rank_gemms.py --device cpu --dim 64 --text-tokens 8 --image-tokens 64 --iterations 1   # checks it
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from mdtriton.harness import device_name, markdown_table, time_calls

REPEATS = 20  # GEMMs per timed call: a GEMM of a slice takes tens of microseconds, near a launch's cost


def gemm_shapes(dim: int) -> dict[str, tuple[int, int]]:
    """A FLUX double block's GEMMs of one stream, (K, N): its width and FLUX's MLP ratio of 4."""
    return {"q/k/v": (dim, 3 * dim), "attention output": (dim, dim), "feed-forward in": (dim, 4 * dim),
            "feed-forward out": (4 * dim, dim)}


def microseconds(call, device: torch.device, iterations: int) -> float:
    """One GEMM's time: the median of timed calls of REPEATS runs of call, after one."""
    def repeated():
        for _ in range(REPEATS):
            call()

    times, _ = time_calls(repeated, device.type == "cuda", 1, iterations)
    return statistics.median(times) * 1000 / REPEATS


def grouped(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor):
    """rows [M, K] times weights [G, K, N], group g taking the rows up to ends[g]; or the error's first line where this
    torch or device has no grouped GEMM for them."""
    try:
        return torch._grouped_mm(rows, weights, offs=ends)
    except (RuntimeError, NotImplementedError) as error:
        return str(error).strip().splitlines()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4", help="context-parallel ranks (default 2,4)")
    parser.add_argument("--dim", type=int, default=3072, help="the model's width (default FLUX.1-dev's 3072)")
    parser.add_argument("--text-tokens", type=int, default=512, help="default 512 (FluxPipeline's T5 length)")
    parser.add_argument("--image-tokens", type=int, default=4096, help="default 4096 (1024x1024)")
    parser.add_argument("--iterations", type=int, default=10, help="timed calls (default 10)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    generator = torch.Generator(device).manual_seed(0)
    table, lag = [], {}
    for ranks in (int(r) for r in args.ranks.split(",")):
        whole = (args.text_tokens + args.image_tokens) // ranks  # the contiguous slice of ranks 1.. (padding aside)
        text = min(args.text_tokens, whole)
        if text == whole:
            raise SystemExit(f"{ranks} ranks: rank 0's slice of {whole} tokens holds text only; give fewer ranks")
        lag[ranks] = 0.0
        for name, (k, n) in gemm_shapes(args.dim).items():
            stacked = torch.randn(2, n, k, generator=generator, device=device, dtype=dtype).transpose(1, 2)
            rows = torch.randn(whole, k, generator=generator, device=device, dtype=dtype)
            ends = torch.tensor([text, whole], dtype=torch.int32, device=device)
            one = microseconds(lambda: rows @ stacked[1], device, args.iterations)
            two = microseconds(lambda: (rows[:text] @ stacked[0], rows[text:] @ stacked[1]), device, args.iterations)
            check = grouped(rows, stacked, ends)
            if isinstance(check, str):
                together = f"- ({check})"
            else:
                separate = torch.cat((rows[:text] @ stacked[0], rows[text:] @ stacked[1]))
                difference = (check.float() - separate.float()).abs().max().item()
                together = (f"{microseconds(lambda: grouped(rows, stacked, ends), device, args.iterations):.1f} "
                            f"(max difference {difference:.1e})")
            lag[ranks] += two - one
            table.append([ranks, name, f"{k} x {n}", f"{one:.1f} (M = {whole})",
                          f"{two:.1f} (M = {text} + {whole - text})", together, f"{two / one:.2f}x"])
    print(f"\nFLUX double block GEMMs, {args.text_tokens} text + {args.image_tokens} image tokens, bf16, "
          f"{device_name(device)}; microseconds per GEMM, median of {args.iterations} x {REPEATS}\n")
    print(markdown_table(["ranks", "GEMM", "K x N", "one GEMM, a slice of image rows", "rank 0: text and image apart",
                          "rank 0: one grouped GEMM", "apart / one"], table))
    for ranks, microsecs in lag.items():
        print(f"{ranks} ranks: rank 0's GEMMs take {microsecs:+.1f} us a double block more than the others' "
              f"({microsecs * 19 / 1000:+.2f} ms a forward of FLUX.1-dev's 19 double blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
