"""The FLUX pipeline served on 1 to N GPUs: prompt to image through Triton, one model per parallel plan.

Every component has random weights and FLUX.1-dev's configs (benchmarks/pipeline_flux.py makes them); the transformer
is built into each plan's engine from one seed, so every plan computes the same model. For each plan (one server each,
the model alone on its GPUs): the time from start to ready, a warm-up image, --images images one after another
(the client's wall time per image: the request, the whole pipeline on every rank, the image back), --concurrent
images sent at once (every rank receives some: rank 0 broadcasts its answer to the others), and each image against
the first plan's image of the same seed (max and mean uint8 difference). A failed request is a row's failure, not
the script's: the table says how many. Rows are printed and appended to --output as each plan ends.

    python benchmarks/served_pipeline.py --plans 1,ulysses4,tp4             # FLUX.1-dev size on GPUs 0..3
    python benchmarks/served_pipeline.py --tiny --plans 1,tp2,ulysses2       # tiny, on CPU ranks: checks the script

Plan names: 1, tpN, ulyssesN, ringN, allgather_kvN, ulysses_ringN (Ulysses pairs in a ring).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_flux import PROMPT, flux_dev_components, save_flux_pipeline_dir, tiny_components  # noqa: E402

from mdtriton.build_tools.build import build_model_version  # noqa: E402
from mdtriton.client.pipeline import generate  # noqa: E402
from mdtriton.engine.manifest import EngineLimits  # noqa: E402
from mdtriton.engine.plan import ParallelPlan  # noqa: E402
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG  # noqa: E402
from mdtriton.harness import markdown_table  # noqa: E402
from mdtriton.server import TritonServer  # noqa: E402


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


def serve_plan(args, name: str, plan: ParallelPlan, pipeline_dir: Path, workdir: Path) -> dict:
    """Build the plan's model, serve it alone, and time its images; the images by seed."""
    model = f"flux_{name}"
    started = time.perf_counter()
    build_model_version(workdir / "repository", model, "flux-pipeline", None, plan, args.data_type, args.device,
                        weights_path=pipeline_dir, limits=EngineLimits(max_tokens=1 << 20), random_transformer=True,
                        random_device="cuda" if args.device == "gpu" else "cpu", progress=False)
    built = time.perf_counter() - started
    row = {"plan": name, "described": str(plan), "build_s": built, "failed": 0, "images": {}}
    started = time.perf_counter()
    with TritonServer(workdir / "repository", model_control_mode="explicit", load_models=(model,),
                      log_file=workdir / f"server-{name}.log") as server:
        row["ready_s"] = time.perf_counter() - started

        def image(seed: int) -> np.ndarray | None:
            try:
                return generate(server.grpc_address, model, PROMPT, args.height, args.width, args.steps, 3.5, seed,
                                timeout=600)[0]
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
    return row


def compare(row: dict, baseline: dict) -> tuple[int, float]:
    """Max and mean uint8 difference of the row's images from the baseline's of the same seeds."""
    worst, means = 0, []
    for seed, image in row["images"].items():
        want = baseline["images"].get(seed)
        if image is None or want is None:
            continue
        difference = np.abs(image.astype(np.int16) - want.astype(np.int16))
        worst, means = max(worst, int(difference.max())), means + [float(difference.mean())]
    return worst, statistics.mean(means) if means else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", default="1,ulysses4", help="plans, the first the baseline (default 1,ulysses4)")
    parser.add_argument("--tiny", action="store_true", help="tiny components on CPU ranks (checks the script)")
    parser.add_argument("--height", type=int, help="pixels (default 1024; --tiny: 64)")
    parser.add_argument("--width", type=int, help="pixels (default 1024; --tiny: 64)")
    parser.add_argument("--steps", type=int, help="denoising steps (default 28; --tiny: 3)")
    parser.add_argument("--images", type=int, default=10, help="images timed one after another (default 10)")
    parser.add_argument("--concurrent", type=int, default=4, help="images sent at once after them (default 4)")
    parser.add_argument("--workdir", type=Path, help="scratch (default a temporary directory; FLUX.1-dev size needs "
                                                     "24 GB of disk per rank of a context-parallel plan)")
    parser.add_argument("--output", type=Path, help="append each plan's row as JSON to this file")
    args = parser.parse_args()
    args.height, args.width = args.height or (64 if args.tiny else 1024), args.width or (64 if args.tiny else 1024)
    args.steps = args.steps or (3 if args.tiny else 28)
    args.device, args.data_type = ("cpu", "FP32") if args.tiny else ("gpu", "BF16")
    plans = {name: plan_of(name) for name in args.plans.split(",")}

    if args.tiny:
        components, config = tiny_components()
    else:
        components, config = flux_dev_components(torch.device("cuda:0"), torch.bfloat16), dict(FLUX_DEV_CONFIG)
    rows = []
    with tempfile.TemporaryDirectory(prefix="served-pipeline-") as scratch:
        workdir = args.workdir or Path(scratch)
        pipeline_dir = save_flux_pipeline_dir(workdir / "pipeline", components, config)
        del components
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        for name, plan in plans.items():
            row = serve_plan(args, name, plan, pipeline_dir, workdir)
            row["max_diff"], row["mean_diff"] = compare(row, rows[0] if rows else row)
            rows.append(row)
            summary = {key: value for key, value in row.items() if key != "images"}
            print(json.dumps(summary), flush=True)
            if args.output:
                with args.output.open("a") as out:
                    out.write(json.dumps(summary) + "\n")
    baseline = rows[0]["image_s"]
    where = "CPU" if args.tiny else torch.cuda.get_device_name(0)
    print(f"\nFLUX pipeline ({'tiny' if args.tiny else 'FLUX.1-dev size'}), {args.width}x{args.height}, {args.steps} "
          f"steps, {args.data_type}, served by Triton, {where}; median of {args.images} images after a warm-up\n")
    print(markdown_table(
        ["plan", "time per image", "speed-up", "first image", f"{args.concurrent} at once", "failed",
         "max / mean uint8 difference from the first plan", "build s", "start to ready s"],
        [[f"{row['plan']} ({row['described']})", f"{row['image_s'] * 1000:,.0f} ms", f"{baseline / row['image_s']:.2f}x",
          f"{row['first_s']:.1f} s", f"{row['concurrent_s']:.1f} s", str(row["failed"]),
          f"{row['max_diff']} / {row['mean_diff']:.2f}", f"{row['build_s']:.0f}", f"{row['ready_s']:.0f}"]
         for row in rows]))
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
