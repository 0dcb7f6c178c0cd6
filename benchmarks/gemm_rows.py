"""FLUX.1-dev's block GEMMs at the rows a rank holds on 1, 2 and 4 GPUs (4,608 / 2,304 / 1,152 rows of a 4,096+512
token forward), one GPU: cuBLAS as the engine runs them (torch.mm / addmm, GELU in the epilogue where the engine has
it), with each BLAS library torch can prefer (--blas), and against Inductor's max-autotune choice (--autotune: Triton
templates beside cuBLAS). Prints each GEMM's time and its rate against the 4,608-row rate (docs/benchmarks.md,
session 21: at 1,152 rows 0.81-0.83 of it, and neither cuBLASLt nor a Triton template does better; timed then as
the mean of back-to-back calls, now by the harness's timer, the median of calls timed one at a time).

    python benchmarks/gemm_rows.py --blas cublas,cublaslt --rows 4608,1152
    python benchmarks/gemm_rows.py --autotune
    python benchmarks/gemm_rows.py --cublaslt-search --rows 4608,1152

--cublaslt-search times, without bias or GELU, torch's GEMM (x @ W^T) against every algorithm cuBLASLt's heuristic
offers for the shape (up to 64, with their tiles and split-K; through nvmath-python, which must be installed), each
call timed inside a CUDA graph so that no launch cost is counted.
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from mdtriton.engine.cuda_graphs import CudaGraphForward
from mdtriton.harness import time_calls, timing

SHAPES = {  # name: (N, K, gelu) for x [M, K] @ W^T [K, N]
    "qkv": (9216, 3072, False), "out": (3072, 3072, False), "mlp_up_gelu": (12288, 3072, True),
    "mlp_down": (3072, 12288, False)}


def time_ms(fn, reps: int) -> float:
    """The median milliseconds of reps calls of fn after 3 (the harness's timer: CUDA events around each call)."""
    return timing(time_calls(fn, True, 3, reps)[0])["median_ms"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="4608,2304,1152")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--autotune", action="store_true", help="also Inductor max-autotune (compiles: ~1 min)")
    parser.add_argument("--blas", default="cublas", help="torch.backends.cuda.preferred_blas_library values, in turn")
    parser.add_argument("--cublaslt-search", action="store_true",
                        help="instead: every cuBLASLt algorithm for each shape, in CUDA graphs (needs nvmath-python)")
    args = parser.parse_args()
    if args.cublaslt_search:
        search_table(args)
        return
    for blas in args.blas.split(","):
        torch.backends.cuda.preferred_blas_library(blas)
        print("blas:", torch.backends.cuda.preferred_blas_library())
        table(args)


def table(args) -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| GEMM | rows | cuBLAS ms | TFLOP/s | rate vs 4,608 rows | max-autotune ms | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    base = {}
    for name, (n, k, gelu) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.02

        def engine(x):
            if gelu:
                return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
            return F.linear(x, weight, bias)

        def plain(x):
            y = F.linear(x, weight, bias)
            return F.gelu(y, approximate="tanh") if gelu else y

        tuned = torch.compile(plain, mode="max-autotune-no-cudagraphs", dynamic=False) if args.autotune else None
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            flops = 2 * rows * n * k
            ms = time_ms(lambda: engine(x), args.reps)
            rate = flops / ms / 1e9
            base.setdefault(name, rate)
            cells = [name, rows, f"{ms:.4f}", f"{rate:.0f}", f"{rate / base[name]:.2f}"]
            if tuned is not None:
                tuned_ms = time_ms(lambda: tuned(x), args.reps)
                cells += [f"{tuned_ms:.4f}", f"{flops / tuned_ms / 1e9:.0f}"]
            else:
                cells += ["", ""]
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def graph_ms(fn, calls: int = 20, reps: int = 20) -> float:
    """The median milliseconds of one call of fn, replayed `calls` at a time in a CUDA graph (no launch cost)."""

    def repeated() -> dict:
        for _ in range(calls):
            fn()
        return {}

    graphed = CudaGraphForward(repeated, max_graphs=1)
    return time_ms(lambda: graphed({}), reps) / calls


def search_table(args) -> None:
    from nvmath.linalg.advanced import Matmul, MatmulPlanPreferences

    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| GEMM | rows | torch mm ms | TFLOP/s | cuBLASLt first choice ms | best of N ms | TFLOP/s | best's tile, "
          "stages, split-K, reduction |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k, _) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            flops = 2 * rows * n * k
            torch_ms = graph_ms(lambda: torch.mm(x, weight.t()))
            mm = Matmul(x, weight.t())  # not freed: its free() fails once a CUDA graph has captured its calls
            times = {}
            for algorithm in mm.plan(preferences=MatmulPlanPreferences(limit=64)):
                try:
                    times[algorithm] = graph_ms(partial(mm.execute, algorithm=algorithm))
                except Exception as error:  # noqa: BLE001 - an algorithm that cannot run in a graph: said, not timed
                    print(f"  {name} {rows}: algorithm {algorithm.algorithm_id} failed: {error}", flush=True)
            if not times:
                continue
            first = mm.algorithms[0]
            best = min(times, key=times.get)
            first_ms = f"{times[first]:.4f}" if first in times else "failed"
            print(f"| {name} | {rows} | {torch_ms:.4f} | {flops / torch_ms / 1e9:.0f} | "
                  f"{first_ms} | {times[best]:.4f} (of {len(times)}) | {flops / times[best] / 1e9:.0f} | "
                  f"{best.tile}, {best.stages}, {best.split_k}, {best.reduction_scheme} |", flush=True)


if __name__ == "__main__":
    main()
