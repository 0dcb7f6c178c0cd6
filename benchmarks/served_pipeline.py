"""A named pipeline served on 1 to N GPUs: prompt (and input images) to image or clip through Triton, one model per
parallel plan and data type. --architecture: flux (FLUX.1-dev), kontext (FLUX.1 Kontext [dev]), wan (Wan 2.1 T2V 14B),
cosmos3 (Cosmos 3), qwen-image (Qwen-Image), qwen-image-edit-plus (Qwen-Image-Edit-2509), flux2 (FLUX.2 [dev]),
flux2-klein (FLUX.2 [klein] 4B) or ltx2 (LTX-2, a clip with its sound).

Every component has random weights and the published configs (mdtriton/testing/random_pipelines.py and
random_diffusers_pipelines.py make them, each config's source named there); FLUX's, Wan's and Cosmos 3's transformer
is built into each plan's engine from one seed, so every plan and data type computes the same model; the others'
transformer is diffusers' own, its random weights in the pipeline directory, split by its plan and compiled on the
ranks (mdtriton/pipeline/generic.py). Qwen-Image's and Qwen-Image-Edit-Plus's requests have a negative prompt (true
classifier-free guidance, true_cfg_scale 4: two transformer calls a step); Qwen-Image's image is 1328x1328 by default,
the others' 1024x1024. Input images (--input-images, random pixels of the image's size): Kontext's one, Qwen-Image-Edit-
Plus's 1 to 3 (default 1), FLUX.2's 0 to 3 (default 0). FLUX.2 [klein] 4B is guidance distilled: 4 steps by default, as
its model card runs it. LTX-2's clip is 768x512 x 121 frames by default, with its sound (compared by its frames).
Disk for the pipeline directory (--workdir), in bf16: FLUX.1-dev's 45 GB, Qwen-Image's and its Edit's 58 GB, LTX-2's
68 GB, FLUX.2 [dev]'s 113 GB (a 32 B transformer and a 24 B text encoder; every rank loads both, so each GPU needs
that much memory too), FLUX.2 [klein]'s 16 GB. For each data type (--data-types: BF16, FP8) and plan (one server
each, the model alone on its GPUs): the build, the time from start to ready, a first image or clip, one more for each other rank
(a rank's first answer costs more: docs/benchmarks.md), --images more one after another (the client's wall time for
each: the request, the whole pipeline on every rank, the answer back; and of it, "the ranks' job": the pipeline's time
in the rank workers, their mean, as their stubs count it on Triton's metrics endpoint, so that the rest is serving's;
each printed as it ends, with the rank that received it and how long it waited there before its job), --concurrent sent
at once (every rank receives some: rank 0 broadcasts its answer to the others), and each answer against the first row's
of the same seed (max and mean uint8 difference, PSNR). With --also-steps S, --images more of S steps each: the two
medians give the time of one denoising step and, by a straight line through them, the time outside the steps (text
encoding, VAE decode, transfer; computed, not timed). A failed request is a row's failure, not the script's: the table
says how many. Rows are printed and appended to --output as each ends; --plot draws their speed-up over the first row
against their GPUs.

With --xdit (FLUX, Wan) or --diffusers (every architecture but Kontext and Cosmos 3), after the served plans: xDiT's
or diffusers' own whole pipeline (benchmarks/pipeline_peers.py: xfuser 0.7.0 as its runner runs it; diffusers' with its
own context parallelism) in each configuration (1, ulyssesN, ringN; xDiT also ulyssesNxringM), on the same pipeline
directory (the same random weights) with the same request and seed, one process per GPU, compiled as xfuser's
--use_torch_compile compiles it, or diffusers' repeated blocks as our served ranks compile them (--peers-eager:
uncompiled). Their rows time the call to the image or clip as a uint8 array on the host (rank 0's wall clock: a first
one, which compiles, then --images more), against the first row's like the others; they have no build, server,
requests at once or steps apart ("-").

    python benchmarks/served_pipeline.py --plans 1,ulysses4,tp4             # FLUX.1-dev size on GPUs 0..3
    python benchmarks/served_pipeline.py --plans 1,ulysses2,ulysses4 --xdit 1,ulysses2,ulysses4 \\
        --peers-time-limit 300 --images 3 --concurrent 0 --plot served-flux.png   # 1, 2 and 4 GPUs against xDiT's
    python benchmarks/served_pipeline.py --plans 1 --data-types BF16,FP8    # FP8 against BF16 on one GPU
    python benchmarks/served_pipeline.py --architecture wan --plans ulysses4,cfg2xulysses2 --steps 4 --also-steps 2 \\
        --images 1 --concurrent 0                                          # Wan 14B size, 720p x 81 frames
    python benchmarks/served_pipeline.py --architecture wan --plans 1,ulysses4 --xdit 1,ulysses4 --steps 2 --images 1 \\
        --concurrent 0 --peers-time-limit 400                 # Wan's clip on 1 and 4 GPUs against xDiT's
    python benchmarks/served_pipeline.py --architecture cosmos3 --plans 1 --images 1 --concurrent 0  # 720p x 189
    python benchmarks/served_pipeline.py --architecture kontext --plans 1,ulysses2 --steps 10 --images 2 \\
        --concurrent 0 --workdir /dev/shm/sp    # Kontext: 1024x1024 made from a 1024x1024 input image (random pixels)
    python benchmarks/served_pipeline.py --tiny --plans 1,tp2,ulysses2       # tiny, on CPU ranks: checks the script
    python benchmarks/served_pipeline.py --architecture qwen-image --plans 1,ulysses2,cfg2 --diffusers ulysses2 \\
        --steps 4 --images 2 --concurrent 0 --workdir /tmp/qi   # Qwen-Image 1328x1328 on 2 GPUs against diffusers'
    python benchmarks/served_pipeline.py --plans 1 --diffusers 1 --images 2 --concurrent 0  # FLUX against FluxPipeline
    python benchmarks/served_pipeline.py --architecture qwen-image-edit-plus --input-images 3 --plans 1,ulysses2 \\
        --diffusers ulysses2 --steps 4 --images 2 --concurrent 0        # an image edited from 3 input images
    python benchmarks/served_pipeline.py --architecture flux2-klein --plans 1,ulysses2 --diffusers 1,ulysses2 \\
        --images 3 --concurrent 0                                       # FLUX.2 [klein] 4B, 4 steps
    python benchmarks/served_pipeline.py --architecture flux2 --plans ulysses2 --diffusers ulysses2 --steps 4 \\
        --images 2 --concurrent 0 --workdir /dev/shm/f2        # FLUX.2 [dev]: 113 GB of pipeline on each GPU
    python benchmarks/served_pipeline.py --architecture ltx2 --plans 1,ulysses2 --diffusers ulysses2 --images 1 \\
        --concurrent 0                                                  # LTX-2: 768x512 x 121 frames and sound
    python benchmarks/served_pipeline.py --tiny --architecture qwen-image --plans 1,ulysses2,cfg2 --diffusers 1 \\
        --peers-eager --images 1 --concurrent 0   # on CPU ranks (diffusers' own parallelism and xDiT need GPUs; any
                                                  # --architecture takes --tiny)
    python benchmarks/served_pipeline.py --plans ulysses4 --xdit ulysses4 --peers-time-limit 300 --images 5 \\
        --concurrent 0 --workdir /dev/shm/sp                    # ours against xDiT's (compiled), on 4 GPUs

Plan names: 1, or parts joined by x: tpN, cfgN, ulyssesN, ringN, allgather_kvN, ulysses_ringN (Ulysses pairs in a
ring): e.g. ulysses4, cfg2xulysses2, tp2xring2.
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

from mdtriton.client.pipeline import generate, generate_clip, generate_video
from mdtriton.engine.plan import ParallelPlan
from mdtriton.harness import build_pipeline, device_name, markdown_table, psnr, started_server
from mdtriton.testing.metrics import rank_counters
from mdtriton.testing.random_diffusers_pipelines import (flux2_klein_pipeline_dir, flux2_pipeline_dir,
                                                         ltx2_pipeline_dir, qwen_image_edit_plus_pipeline_dir)
from mdtriton.testing.random_pipelines import (IMAGE_ARCHITECTURES, MODEL_SIZES, REQUESTS, add_pipeline_arguments,
                                               cosmos3_pipeline_dir, fill_clip_sizes, flux_pipeline_dir,
                                               kontext_pipeline_dir, pipeline_device, plan_of,
                                               qwen_image_pipeline_dir, wan_pipeline_dir, work_directory)
from pipeline_peers import PIPELINES, PeerJob, degrees_of, peer_request, peer_row

# The architecture each --architecture builds.
SERVED_ARCHITECTURES = {"flux": "flux-pipeline", "kontext": "flux-kontext-pipeline", "wan": "wan-pipeline",
                        "cosmos3": "cosmos3-pipeline", "qwen-image": "qwen-image-pipeline",
                        "qwen-image-edit-plus": "qwen-image-edit-plus-pipeline", "flux2": "flux2-pipeline",
                        "flux2-klein": "flux2-klein-pipeline", "ltx2": "ltx2-pipeline"}
# The pipeline directory each --architecture makes.
PIPELINE_DIRS = {"flux": flux_pipeline_dir, "kontext": kontext_pipeline_dir, "wan": wan_pipeline_dir,
                 "cosmos3": cosmos3_pipeline_dir, "qwen-image": qwen_image_pipeline_dir,
                 "qwen-image-edit-plus": qwen_image_edit_plus_pipeline_dir, "flux2": flux2_pipeline_dir,
                 "flux2-klein": flux2_klein_pipeline_dir, "ltx2": ltx2_pipeline_dir}
# The input images each architecture's request may carry: (default, fewest, most); the others take none.
INPUT_IMAGES = {"kontext": (1, 1, 1), "qwen-image-edit-plus": (1, 1, 3), "flux2": (0, 0, 3),
                "flux2-klein": (0, 0, 3)}
# Qwen-Image's and Qwen-Image-Edit-Plus's request: a negative prompt (true classifier-free guidance, as their model
# cards run it).
QWEN_IMAGE_NEGATIVE_PROMPT = " "
TRUE_CFG_ARCHITECTURES = ("qwen-image", "qwen-image-edit-plus")


def serve_plan(args, name: str, plan: ParallelPlan, data_type: str, pipeline_dir: Path, device: torch.device,
               workdir: Path) -> dict:
    """Build the plan's model in the data type, serve it alone, and time its images; the images by seed."""
    model = f"{args.architecture}_{name}_{data_type.lower()}"
    started = time.perf_counter()
    build_pipeline(workdir / "repository", model, SERVED_ARCHITECTURES[args.architecture], pipeline_dir, data_type,
                   device, plan)
    input_images = random_images(args)
    row = {"plan": name, "gpus": plan.world_size, "data_type": data_type, "described": str(plan),
           "build_s": time.perf_counter() - started,
           "failed": 0, "images": {}}
    with started_server(workdir / "repository", workdir / f"server-{model}.log", (model,)) as (server, ready_s):
        row["ready_s"] = ready_s

        def image(seed: int, steps: int = args.steps) -> np.ndarray | None:
            prompt, guidance = REQUESTS[args.architecture]
            try:
                if args.architecture in TRUE_CFG_ARCHITECTURES:
                    return generate(server.grpc_address, model, prompt, args.height, args.width, steps, None, seed,
                                    negative_prompt=QWEN_IMAGE_NEGATIVE_PROMPT, true_cfg_scale=guidance,
                                    timeout=600, images=input_images or None)[0]
                if args.architecture == "ltx2":  # the clip's frames (its sound is not compared)
                    return generate_clip(server.grpc_address, model, prompt, args.height, args.width, args.frames,
                                         None, steps, guidance, seed, timeout=1200)[0][0]
                if args.architecture not in IMAGE_ARCHITECTURES:
                    return generate_video(server.grpc_address, model, prompt, args.height, args.width,
                                          args.frames, steps, guidance, seed, timeout=1200)[0]
                return generate(server.grpc_address, model, prompt, args.height, args.width, steps, guidance,
                                seed, timeout=600, images=input_images or None)[0]
            except Exception as error:  # noqa: BLE001 - a failed request is counted, the benchmark goes on
                print(f"{name}: seed {seed} failed: {error}", flush=True)
                row["failed"] += 1
                return None

        started = time.perf_counter()
        row["images"][0] = image(0)
        row["first_s"] = time.perf_counter() - started
        # A rank's first answer to a request it received took 0.1-0.5 s more than its later ones on 4 GPUs (not in
        # its job: docs/benchmarks.md): as Triton hands the requests to the instances in turn, every rank answers one
        # before the timed images.
        for _ in range(plan.world_size - 1):
            image(0)
        times, jobs = [], []
        before = rank_counters(server.metrics_url)  # each scrape waits for the counters to settle: once per image
        for number in range(1, args.images + 1):
            started = time.perf_counter()
            image(0)
            times.append(time.perf_counter() - started)
            after = rank_counters(server.metrics_url)
            jobs.append(statistics.mean(after["job"][rank] - before["job"][rank] for rank in after["job"]))
            origin = max(after["received"], key=lambda rank: after["received"][rank] - before["received"][rank])
            print(f"{name}: image {number}: {times[-1] * 1000:,.0f} ms, the ranks' job {jobs[-1] * 1000:,.0f} ms; "
                  f"received by rank {origin}, waited there "
                  f"{(after['waited'][origin] - before['waited'][origin]) * 1000:,.1f} ms before its job", flush=True)
            before = after
        row["image_s"] = statistics.median(times)
        row["image_min_s"] = min(times)
        row["job_s"] = statistics.median(jobs)
        if args.also_steps:
            fewer = []
            for _ in range(args.images):
                started = time.perf_counter()
                image(0, args.also_steps)
                fewer.append(time.perf_counter() - started)
            row["step_s"] = (row["image_s"] - statistics.median(fewer)) / (args.steps - args.also_steps)
            row["outside_steps_s"] = row["image_s"] - args.steps * row["step_s"]
        seeds = list(range(1, args.concurrent + 1))
        started = time.perf_counter()
        if seeds:
            with ThreadPoolExecutor(args.concurrent) as pool:
                row["images"].update(zip(seeds, pool.map(image, seeds)))
        row["concurrent_s"] = time.perf_counter() - started
    shutil.rmtree(workdir / "repository" / model)  # the disk holds one model at a time (24 GB a shard at full size)
    return row


def random_images(args) -> list[np.ndarray]:
    """The request's input images (--input-images): random pixels of the image's size, the same for every plan and
    peer (the work does not depend on them)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8) for _ in range(args.input_images)]


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


def cell(row: dict, key: str, form: str, scale: float = 1) -> str:
    """row[key] times scale in form, or "-" where the row has none (the peers' rows: no build, server, requests at once
    or steps apart; a failed peer's row: no times)."""
    return form.format(row[key] * scale) if key in row else "-"


def plot(rows: list[dict], baseline_s: float, title: str, path: Path) -> None:
    """Each row's speed-up over the first row against its GPUs: a line per parallel method of each implementation
    (ours, xDiT, diffusers), through that implementation's 1-GPU row where there is one; failed rows left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in rows:
        if "image_s" in row:
            implementation, _, name = row["plan"].rpartition(" ")
            method = re.sub(r"\d+", "", name).replace("x", " x ") if name != "1" else ""
            points.setdefault((implementation or "ours", method), []).append((row["gpus"], baseline_s / row["image_s"]))
    figure, axis = plt.subplots(figsize=(6, 4.5))
    for implementation in sorted({implementation for implementation, _ in points}):
        single = points.get((implementation, ""), [])
        methods = sorted(method for other, method in points if other == implementation and method)
        lines = {f"{implementation}, {method}": sorted(single + points[implementation, method]) for method in methods}
        for label, line in (lines or {f"{implementation}, 1 GPU": single}).items():
            axis.plot([gpus for gpus, _ in line], [speed for _, speed in line], marker="o", label=label)
    gpus = sorted({row["gpus"] for row in rows})
    axis.plot(gpus, gpus, linestyle="--", color="gray", label="ideal")
    axis.set(title=title, xlabel="GPUs", ylabel="speed-up over the first row", xticks=gpus)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", choices=tuple(SERVED_ARCHITECTURES), default="flux",
                        help="the pipeline at its published configs (above; default flux): images (flux, kontext, "
                             "qwen-image, qwen-image-edit-plus, flux2, flux2-klein) or clips (wan, cosmos3, ltx2)")
    parser.add_argument("--plans", default="1,ulysses4", help="plans, the first the baseline (default 1,ulysses4)")
    parser.add_argument("--data-types", help="the transformer's data types, the first the baseline: BF16, FP8 (GPUs of "
                                             "compute capability 8.9+), FP32 (default BF16; --tiny: FP32)")
    add_pipeline_arguments(parser, tiny_steps=3, disk_gb=45)
    parser.add_argument("--images", type=int, default=10, help="images timed one after another (default 10)")
    parser.add_argument("--concurrent", type=int, default=4, help="images sent at once after them (default 4)")
    parser.add_argument("--frames", type=int, help="a clip's frames (default: Wan 81, Cosmos 3 189, LTX-2 121; --tiny: "
                                                   "9)")
    parser.add_argument("--input-images", type=int, help="input images of the request, random pixels of the image's "
                                                         "size: qwen-image-edit-plus 1 to 3 (default 1), flux2 and "
                                                         "flux2-klein 0 to 3 (default 0); kontext takes 1")
    parser.add_argument("--also-steps", type=int, help="also time --images requests of this many steps (fewer than "
                                                       "--steps): the time per step and outside the steps")
    parser.add_argument("--xdit", help="FLUX, Wan: after the plans, xDiT's pipeline in these configurations (1, "
                                       "ulyssesN, ringN, ulyssesNxringM; benchmarks/pipeline_peers.py), compiled as "
                                       "xfuser's --use_torch_compile compiles it (GPUs only)")
    parser.add_argument("--diffusers", help="every architecture but kontext and cosmos3: after the plans, diffusers' "
                                            "own pipeline and context parallelism in these configurations (1, "
                                            "ulyssesN, ringN; benchmarks/pipeline_peers.py), compiled as ours")
    parser.add_argument("--peers-eager", action="store_true", help="xDiT's and diffusers' rows uncompiled")
    parser.add_argument("--peers-time-limit", type=float, default=0,
                        help="seconds an xDiT or diffusers configuration may take, loading included, before its "
                             "ranks are stopped and its row marked failed, so that the table still prints (default 0: "
                             "no limit)")
    parser.add_argument("--output", type=Path, help="append each row as JSON to this file")
    parser.add_argument("--plot", type=Path, help="draw each row's speed-up over the first row against its GPUs into "
                                                  "this PNG file, a line per method (ours and the peers')")
    args = parser.parse_args()
    fill_clip_sizes(args)
    if args.architecture == "qwen-image" and not args.tiny:
        args.height, args.width = args.height or 1328, args.width or 1328
    if args.architecture == "flux2-klein" and not args.tiny:
        args.steps = args.steps or 4
    default, fewest, most = INPUT_IMAGES.get(args.architecture, (0, 0, 0))
    args.input_images = default if args.input_images is None else args.input_images
    if not fewest <= args.input_images <= most:
        raise SystemExit(f"--input-images {args.input_images}: {args.architecture} takes {fewest} to {most}")
    device = pipeline_device(args, tiny_steps=3)
    if args.also_steps and not 0 < args.also_steps < args.steps:
        raise SystemExit(f"--also-steps {args.also_steps}: give fewer steps than --steps {args.steps}")
    data_types = (args.data_types or ("FP32" if args.tiny else "BF16")).split(",")
    plans = {name: plan_of(name) for name in args.plans.split(",")}
    peers = {"xDiT": args.xdit.split(",") if args.xdit else [],
             "diffusers": args.diffusers.split(",") if args.diffusers else []}
    for peer, architectures in (("xDiT", ("flux", "wan")), ("diffusers", tuple(PIPELINES))):
        if peers[peer] and args.architecture not in architectures:
            raise SystemExit(f"{peer}'s pipeline runs with --architecture {' or '.join(architectures)}")
        for name in peers[peer]:
            degrees_of(name)
    if peers["xDiT"] and device.type != "cuda":
        raise SystemExit("xDiT's pipeline runs on GPUs: leave --xdit out with --tiny")

    rows = []
    with work_directory(args) as workdir:
        pipeline_dir, _ = PIPELINE_DIRS[args.architecture](workdir / "pipeline", args.tiny, device)

        def record(row: dict) -> None:
            row["max_diff"], row["mean_diff"], row["psnr"] = compare(row, rows[0] if rows else row)
            rows.append(row)
            summary = {key: value for key, value in row.items() if key != "images"}
            print(json.dumps(summary), flush=True)
            if args.output:
                with args.output.open("a") as out:
                    out.write(json.dumps(summary) + "\n")

        for data_type in data_types:
            for name, plan in plans.items():
                record(serve_plan(args, name, plan, data_type, pipeline_dir, device, workdir))
        prompt, guidance = REQUESTS[args.architecture]
        request = peer_request(args.architecture, prompt, guidance, args.height, args.width, args.steps, args.frames,
                               QWEN_IMAGE_NEGATIVE_PROMPT, random_images(args))
        for peer, names in peers.items():  # after the served plans, on the same pipeline directory
            job = PeerJob(peer, args.architecture, pipeline_dir, device.type, not args.peers_eager, request, 0,
                          args.images, workdir / peer, args.peers_time_limit)
            for name in names:
                record(peer_row(name, job))
    baseline = rows[0]["image_s"]
    what, size = (("image", f"{args.width}x{args.height}") if args.architecture in IMAGE_ARCHITECTURES
                  else ("clip", f"{args.width}x{args.height} x {args.frames} frames"))
    model_size = "tiny" if args.tiny else MODEL_SIZES[args.architecture]
    if args.input_images:
        size += f" from {args.input_images} input image{'s' if args.input_images > 1 else ''} of that size"
    print(f"\n{args.architecture} pipeline ({model_size}), {size}, {args.steps} steps, served by Triton, "
          f"{device_name(device)}; median of {args.images} {what}s after a first one\n")
    split = ["per step", "outside the steps"] if args.also_steps else []
    print(markdown_table(
        ["plan", "transformer", f"time per {what}", "speed-up", "the ranks' job", *split, f"first {what}",
         f"{args.concurrent} at once",
         "failed", "max / mean uint8 difference from the first row, least PSNR", "build s", "start to ready s"],
        [[f"{row['plan']} ({row['described']})", row["data_type"], cell(row, "image_s", "{:,.0f} ms", 1000),
          f"{baseline / row['image_s']:.2f}x" if "image_s" in row else "-", cell(row, "job_s", "{:,.0f} ms", 1000),
          *([cell(row, "step_s", "{:,.0f} ms", 1000), cell(row, "outside_steps_s", "{:,.0f} ms", 1000)]
            if args.also_steps else []),
          cell(row, "first_s", "{:.1f} s"), cell(row, "concurrent_s", "{:.1f} s"),
          str(row["failed"]),
          f"{row['max_diff']} / {row['mean_diff']:.2f}, {row['psnr']:.1f} dB" if row["images"] else "-",
          cell(row, "build_s", "{:.0f}"), cell(row, "ready_s", "{:.0f}")] for row in rows]))
    if args.plot:
        plot(rows, baseline, f"{model_size} {args.architecture} {what}, {size}, {args.steps} steps", args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
