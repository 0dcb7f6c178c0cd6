"""Where a forward's communication is exposed, from the Chrome traces that `mdtriton bench --traces DIR` writes (one
per rank, plan and size): the stretches of a rank's GPU timeline in which NCCL kernels ran and nothing else did (the
bench's "NCCL alone"), and those in which no kernel ran (its "GPU idle"), each put down to the compute kernels just
before and just after it, summed by that pair of names. The pairs say where in a block the time goes (which GEMM a
transfer outlasted, which kernel waited for an arrival).

    mdtriton bench ... --traces /tmp/traces
    python benchmarks/exposed_nccl.py /tmp/traces/4gpu-ulysses-compiled-1024x1024-rank0.json.gz [--top 12]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

from mdtriton.bench import PROFILED_CALL, union
from mdtriton.harness import kind_of

NAME_WIDTH = 60


def gpu_kernels(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) of the kernels of the profiled call, in microseconds, sorted by start."""
    events = trace["traceEvents"]
    begin = min((event["ts"] for event in events
                 if event.get("cat") == "gpu_user_annotation" and event.get("name") == PROFILED_CALL), default=None)
    kernels = [(event["ts"], event["ts"] + event["dur"], event["name"]) for event in events
               if event.get("cat") == "kernel" and (begin is None or event["ts"] >= begin)]
    return sorted(kernels)


def subtract(intervals: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the (disjoint, sorted) intervals outside the (disjoint, sorted) cut."""
    left, index = [], 0
    for start, end in intervals:
        while index < len(cut) and cut[index][1] <= start:
            index += 1
        position, scan = start, index
        while scan < len(cut) and cut[scan][0] < end:
            if cut[scan][0] > position:
                left.append((position, cut[scan][0]))
            position = max(position, cut[scan][1])
            scan += 1
        if position < end:
            left.append((position, end))
    return left


def is_nccl(name: str) -> bool:
    return kind_of(name) == "NCCL"


def stretches(kernels: list[tuple[float, float, str]]) -> dict[str, list[tuple[float, float]]]:
    """The timeline's stretches of NCCL alone ("exposed") and of no kernel ("idle")."""
    compute = union([(start, end) for start, end, name in kernels if not is_nccl(name)])
    anything = union([(start, end) for start, end, _ in kernels])
    nccl = union([(start, end) for start, end, name in kernels if is_nccl(name)])
    gaps = [(anything[i][1], anything[i + 1][0]) for i in range(len(anything) - 1)]
    return {"exposed": subtract(nccl, compute), "idle": gaps}


def neighbours(kernels: list[tuple[float, float, str]], start: float, end: float) -> tuple[str, str]:
    """The names of the compute kernels that ended last at or before start and began first at or after end."""
    before = max(((k_end, name) for k_start, k_end, name in kernels if not is_nccl(name) and k_end <= start),
                 default=(0.0, "(start)"))[1]
    after = min(((k_start, name) for k_start, k_end, name in kernels if not is_nccl(name) and k_start >= end),
                default=(0.0, "(end)"))[1]
    return before[:NAME_WIDTH], after[:NAME_WIDTH]


def summary(path: Path, top: int) -> str:
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as file:
        kernels = gpu_kernels(json.load(file))
    lines = [f"{path.name}: {len(kernels)} kernels"]
    for kind, found in stretches(kernels).items():
        by_pair: dict[tuple[str, str], list[float]] = defaultdict(list)
        for start, end in found:
            by_pair[neighbours(kernels, start, end)].append(end - start)
        total = sum(end - start for start, end in found) / 1000
        lines.append(f"\n{kind}: {total:.2f} ms in {len(found)} stretches; by the compute kernels around them:\n")
        lines.append("| ms | stretches | mean us | before | after |\n|---|---|---|---|---|")
        ranked = sorted(by_pair.items(), key=lambda item: -sum(item[1]))
        for (before, after), lengths in ranked[:top]:
            lines.append(f"| {sum(lengths) / 1000:.2f} | {len(lengths)} | {sum(lengths) / len(lengths):.1f} | "
                         f"`{before}` | `{after}` |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", type=Path, nargs="+", help="Chrome traces (.json or .json.gz) of `mdtriton bench`")
    parser.add_argument("--top", type=int, default=12, help="pairs of kernels to list per kind (default 12)")
    args = parser.parse_args()
    for path in args.traces:
        print(summary(path, args.top), end="\n\n")


if __name__ == "__main__":
    main()
