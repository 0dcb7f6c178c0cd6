"""The FLUX pipeline served on 1 to N GPUs: prompt to image through Triton, one model per parallel plan and data type.

Every component has random weights and FLUX.1-dev's configs (benchmarks/random_pipelines.py makes them); the
transformer is built into each plan's engine from one seed, so every plan and data type computes the same model. For
each data type (--data-types: BF16, FP8) and plan (one server each, the model alone on its GPUs): the build, the time
from start to ready, a first image, --images images one after another (the client's wall time per image: the request,
the whole pipeline on every rank, the image back), --concurrent images sent at once (every rank receives some: rank 0
broadcasts its answer to the others), and each image against the first row's image of the same seed (max and mean
uint8 difference, PSNR). A failed request is a row's failure, not the script's: the table says how many. Rows are
printed and appended to --output as each ends.

    python benchmarks/served_pipeline.py --plans 1,ulysses4,tp4             # FLUX.1-dev size on GPUs 0..3
    python benchmarks/served_pipeline.py --plans 1 --data-types BF16,FP8    # FP8 against BF16 on one GPU
    python benchmarks/served_pipeline.py --tiny --plans 1,tp2,ulysses2       # tiny, on CPU ranks: checks the script

Plan names: 1, tpN, ulyssesN, ringN, allgather_kvN, ulysses_ringN (Ulysses pairs in a ring).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from random_pipelines import FLUX_PROMPT, add_pipeline_arguments, flux_pipeline_dir, pipeline_device, work_directory

from mdtriton.client.pipeline import generate
from mdtriton.engine.plan import ParallelPlan
from mdtriton.harness import build_pipeline, device_name, markdown_table, psnr, started_server


def plan_of(name: str) -> ParallelPlan:
    """'1', 'tp4', 'ulysses4', 'ring4', 'allgather_kv4', 'ulysses_ring4' -> the plan."""
    if name == "1":
        return ParallelPlan()
    match = re.fullmatch(r"(tp|ulysses_ring|ulysses|ring|allgather_kv)(\d+)", name)
    if not match:
        raise SystemExit(f"unknown plan {name!r}: 1, tpN, ulyssesN, ringN, allgather_kvN or ulysses_ringN")
    method, size = match.group(1), int(match.group(2))
    if method == "tp":
        return ParallelPlan(tp_size=size)
    return ParallelPlan(cp_size=size, cp_method=method, ulysses_size=2 if method == "ulysses_ring" else 1)


def serve_plan(args, name: str, plan: ParallelPlan, data_type: str, pipeline_dir: Path, device: torch.device,
               workdir: Path) -> dict:
    """Build the plan's model in the data type, serve it alone, and time its images; the images by seed."""
    model = f"flux_{name}_{data_type.lower()}"
    started = time.perf_counter()
    build_pipeline(workdir / "repository", model, "flux-pipeline", pipeline_dir, data_type, device, plan)
    row = {"plan": name, "data_type": data_type, "described": str(plan), "build_s": time.perf_counter() - started,
           "failed": 0, "images": {}}
    with started_server(workdir / "repository", workdir / f"server-{model}.log", (model,)) as (server, ready_s):
        row["ready_s"] = ready_s

        def image(seed: int) -> np.ndarray | None:
            try:
                return generate(server.grpc_address, model, FLUX_PROMPT, args.height, args.width, args.steps, 3.5,
                                seed, timeout=600)[0]
            except Exception as error:  # noqa: BLE001 - a failed request is counted, the benchmark goes on
                print(f"{name}: seed {seed} failed: {error}", flush=True)
                row["failed"] += 1
                return None

        started = time.perf_counter()
        row["images"][0] = image(0)
        row["first_s"] = time.perf_counter() - started
        times = []
        for _ in range(args.images):
            started = time.perf_counter()
            image(0)
            times.append(time.perf_counter() - started)
        row["image_s"] = statistics.median(times)
        row["image_min_s"] = min(times)
        seeds = list(range(1, args.concurrent + 1))
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrent) as pool:
            row["images"].update(zip(seeds, pool.map(image, seeds)))
        row["concurrent_s"] = time.perf_counter() - started
    shutil.rmtree(workdir / "repository" / model)  # the disk holds one model at a time (24 GB a rank at full size)
    return row


def compare(row: dict, baseline: dict) -> tuple[int, float, float]:
    """Max and mean uint8 difference and the least PSNR of the row's images from the baseline's of the same seeds."""
    worst, means, least = 0, [], float("inf")
    for seed, image in row["images"].items():
        want = baseline["images"].get(seed)
        if image is None or want is None:
            continue
        difference = np.abs(image.astype(np.int16) - want.astype(np.int16))
        worst, means = max(worst, int(difference.max())), means + [float(difference.mean())]
        least = min(least, psnr(image, want))
    return worst, statistics.mean(means) if means else float("nan"), least


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", default="1,ulysses4", help="plans, the first the baseline (default 1,ulysses4)")
    parser.add_argument("--data-types", help="the transformer's data types, the first the baseline: BF16, FP8 (GPUs of "
                                             "compute capability 8.9+), FP32 (default BF16; --tiny: FP32)")
    add_pipeline_arguments(parser, tiny_steps=3, disk_gb=45)
    parser.add_argument("--images", type=int, default=10, help="images timed one after another (default 10)")
    parser.add_argument("--concurrent", type=int, default=4, help="images sent at once after them (default 4)")
    parser.add_argument("--output", type=Path, help="append each row as JSON to this file")
    args = parser.parse_args()
    device = pipeline_device(args, tiny_steps=3)
    data_types = (args.data_types or ("FP32" if args.tiny else "BF16")).split(",")
    plans = {name: plan_of(name) for name in args.plans.split(",")}

    rows = []
    with work_directory(args) as workdir:
        pipeline_dir, _ = flux_pipeline_dir(workdir / "pipeline", args.tiny, device)
        for data_type in data_types:
            for name, plan in plans.items():
                row = serve_plan(args, name, plan, data_type, pipeline_dir, device, workdir)
                row["max_diff"], row["mean_diff"], row["psnr"] = compare(row, rows[0] if rows else row)
                rows.append(row)
                summary = {key: value for key, value in row.items() if key != "images"}
                print(json.dumps(summary), flush=True)
                if args.output:
                    with args.output.open("a") as out:
                        out.write(json.dumps(summary) + "\n")
    baseline = rows[0]["image_s"]
    print(f"\nFLUX pipeline ({'tiny' if args.tiny else 'FLUX.1-dev size'}), {args.width}x{args.height}, {args.steps} "
          f"steps, served by Triton, {device_name(device)}; median of {args.images} images after a first one\n")
    print(markdown_table(
        ["plan", "transformer", "time per image", "speed-up", "first image", f"{args.concurrent} at once", "failed",
         "max / mean uint8 difference from the first row, least PSNR", "build s", "start to ready s"],
        [[f"{row['plan']} ({row['described']})", row["data_type"], f"{row['image_s'] * 1000:,.0f} ms",
          f"{baseline / row['image_s']:.2f}x", f"{row['first_s']:.1f} s", f"{row['concurrent_s']:.1f} s",
          str(row["failed"]), f"{row['max_diff']} / {row['mean_diff']:.2f}, {row['psnr']:.1f} dB",
          f"{row['build_s']:.0f}", f"{row['ready_s']:.0f}"] for row in rows]))
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
