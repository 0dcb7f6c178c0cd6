"""A transformer forward's time by the number of head groups Ulysses' and allgather_kv's exchanges run in: the
numbers the group count (mdtriton/engine/attention/ulysses.py, head_groups) is chosen from. For each method and each
count of --groups (counts that do not divide the heads are said and skipped; picked: the count the engine picks
itself) an engine is loaded as the server loads it (compiled on GPUs, CUDA graphs for small requests) with the
exchange's group count forced, and its forwards timed at every size; one GPU's forward is timed first, for the
speed-ups. Prints one table.

    python benchmarks/head_groups.py --architecture flux --gpus 4 --methods ulysses,allgather_kv \
        --height 1024,2048 --width 1024,2048 --groups 1,2,3 --iterations 5
    python benchmarks/head_groups.py --architecture wan --gpus 4 --height 480,720 --width 832,1280 --frames 81 \
        --groups 1,2,5,picked --iterations 2
    python benchmarks/head_groups.py --architecture wan --device cpu --preset tiny --gpus 2 --height 32 --width 48 \
        --frames 9 --methods ulysses,allgather_kv --warmup 0 --iterations 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from mdtriton.engine.attention import allgather_kv, ulysses
from mdtriton.engine.comm import Communicator
from mdtriton.bench import benchmarked_architectures, free_memory
from mdtriton.families import family
from mdtriton.families.family import AttentionShape
from mdtriton.harness import (add_model_arguments, bench_engine, bench_weights, init_rank, markdown_table,
                              model_config, model_sizes, plans_for, precision, run_ranks, time_calls, timing)

MODULES = {"ulysses": ulysses, "allgather_kv": allgather_kv}
PICK = ulysses.head_groups  # the engine's own choice


def forced(groups: int | None, picked: list[int]):
    """head_groups giving `groups` (None: the engine's own choice); each count it gives is appended to picked."""
    def choose(rows_per_head: int, *heads: int) -> int:
        count = PICK(rows_per_head, *heads) if groups is None else groups
        picked.append(count)
        return count
    return choose


def divides(groups: int, method: str, shape: AttentionShape, ranks: int) -> bool:
    """Whether the heads an exchange of `method` splits on `ranks` ranks divide into `groups` groups (Ulysses: each
    rank's share of the heads; allgather_kv: all of them)."""
    share = ranks if method == "ulysses" else 1
    return all(heads % share == 0 and heads // share % groups == 0 for heads in (shape.heads, shape.kv_heads))


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, work_dir: str) -> None:
    cuda = args.device == "cuda"
    device = init_rank(rank, world_size, port, cuda)
    model_family = family(args.architecture)
    config = model_config(args)
    dtype, data_type = precision(device)
    requests = {str(size): {name: tensor.to(device) for name, tensor in
                            model_family.media_request(config, size.frames, size.height, size.width, dtype).items()}
                for size in args.sizes}
    plans = plans_for(world_size, ["1 GPU"] if world_size == 1 else args.methods)
    rows = []
    for method, plan in plans.items():
        comm = Communicator(plan, rank, device)
        comm.join_groups()
        for groups in [None] if world_size == 1 else args.groups:
            if groups not in (None, "picked") and not divides(groups, method, model_family.attention_shape(config), world_size):
                if rank == 0:
                    print(f"skipped {method} in {groups} head groups: they do not divide its heads", flush=True)
                continue
            picked = []
            if method in MODULES:
                MODULES[method].head_groups = forced(None if groups == "picked" else groups, picked)
            weights = bench_weights(args.architecture, config, plan, rank, device, dtype, None)
            engine = bench_engine(args.architecture, config, comm, weights, data_type)
            for size, request in requests.items():
                times, _ = time_calls(lambda: engine.forward(request)["sample"], cuda, args.warmup, args.iterations)
                row = {"method": method, "size": size, "groups": groups, "picked": sorted(set(picked)),
                       **timing(times)}
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
            engine = None
            free_memory(device)
        if method in MODULES:
            MODULES[method].head_groups = PICK
    if rank == 0:
        (Path(work_dir) / f"rows-{world_size}.json").write_text(json.dumps(rows))
    if dist.is_initialized():
        dist.destroy_process_group()


def groups_cell(row: dict) -> str:
    if row["groups"] == "picked":
        return f"picked ({'/'.join(map(str, row['picked']))})"
    return "" if row["groups"] is None else str(row["groups"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, benchmarked_architectures())
    parser.add_argument("--gpus", type=int, default=4, help="ranks (default 4); one GPU's forward is timed first")
    parser.add_argument("--methods", default="ulysses", help="ulysses, allgather_kv or both, comma-separated")
    parser.add_argument("--groups", default="1,2,picked",
                        help="the group counts to force, comma-separated; picked: the engine's own (default 1,2,picked)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    args.methods = args.methods.split(",")
    if set(args.methods) - set(MODULES):
        parser.error(f"--methods takes {', '.join(MODULES)}")
    args.groups = [n if n == "picked" else int(n) for n in args.groups.split(",")]
    config = model_config(args)
    args.sizes = model_sizes(args, config)
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        for world_size in (1, args.gpus):
            problem = run_ranks(_rank_main, world_size, (args, work_dir))
            if problem:
                raise SystemExit(problem)
            rows += json.loads((Path(work_dir) / f"rows-{world_size}.json").read_text())
    single = {r["size"]: r["median_ms"] for r in rows if r["method"] == "1 GPU"}
    print(f"\n{args.architecture} {args.preset}, one forward (median of {args.iterations} after {args.warmup}):\n")
    print(markdown_table(["size", "method", "head groups", "median ms", "min ms", "speed-up"],
                         [[r["size"], r["method"], groups_cell(r), f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}",
                           f"{single[r['size']] / r['median_ms']:.2f}x"] for r in rows]))


if __name__ == "__main__":
    main()
