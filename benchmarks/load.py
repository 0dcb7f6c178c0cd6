"""The FLUX pipeline served under load in several layouts of the same N GPUs: throughput, latency per size, requests
within a deadline and GPU busy time, for open-loop arrivals and closed-loop clients with mixed sizes.

The pipeline has random weights and FLUX.1-dev's published configs (mdtriton/testing/random_pipelines.py; --tiny: the
tests' tiny pipeline on CPU ranks, which checks the script and measures nothing). Each layout is built and served
alone, one server at a time, then removed:

- static1: N one-GPU models, one per GPU (the model is built once; the others are its copies, hard-linked, on the
  other GPUs); each request goes to the model with the fewest requests in flight, as a load balancer sends it;
- static2: N/2 models of 2 GPUs (ulysses 2), the same way (4 GPUs or more);
- staticN: one model of N GPUs (ulysses N);
- elastic: one model of N GPUs (ulysses N) built with the build's elastic option (`mdtriton build --elastic`); skipped,
  saying so, where the build has no such option or refuses it.

In each layout: a warm-up (every size on every model, each size once per rank one after another and then one per rank
at once, so that compiles and CUDA graph captures happen before anything is timed); the lone requests (each size
--lone-repeats times, one after another: their median is the layout's lone latency); for each of --loads, --requests
open-loop requests arriving as a Poisson process at that share of the machine's capacity as N one-GPU models (N over
the mean of the sizes' lone one-GPU times: the static1 layout's lone latencies, which must then come first, or
--one-gpu-seconds); then --requests requests from --clients closed-loop clients (saturation). Sizes are square, drawn
from --sizes at random with --seed (every layout gets the same sequence). Each load reports its throughput (answered
images per second from the first request sent to the last answer), mean, p50 and p99 latency per size and over all
(answered requests), the share within a deadline of twice the size's lone one-GPU time (failures miss it), failures,
and GPU busy (the ranks' job seconds, as their stubs count them on Triton's metrics endpoint, over N GPUs times the
load's wall time). Tables are printed as each layout ends, rows appended to --output (JSON lines) as each load ends;
--plot draws mean and p99 latency against load per layout (needs matplotlib).

    python benchmarks/load.py --steps 8 --sizes 512,1024,1536 --loads 0.5,0.8 --clients 8 --requests 24 \\
        --workdir /dev/shm/load --output load.jsonl --plot load.png       # every GPU of the host
    python benchmarks/load.py --tiny --layouts static1,staticN,elastic --requests 8   # tiny, 2 CPU ranks: the check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mdtriton.build_tools.model_config import read_model_config, write_model_config
from mdtriton.client.pipeline import generate
from mdtriton.engine.plan import ParallelPlan
from mdtriton.harness import build_pipeline, device_name, markdown_table, started_server
from mdtriton.server import ServerError
from mdtriton.testing.load import (LeastBusy, Request, mixed_requests, poisson_requests, run_closed_loop,
                                   run_open_loop, summarize, timed)
from mdtriton.testing.metrics import job_seconds
from mdtriton.testing.random_pipelines import REQUESTS, flux_pipeline_dir, plan_of, work_directory

LAYOUTS = ("static1", "static2", "staticN", "elastic")
REQUEST_TIMEOUT_S = 600


@dataclass(frozen=True)
class Layout:
    """A way to serve the pipeline on the GPUs: `models` copies of a model of `plan`, on GPUs one after another."""

    name: str
    plan: ParallelPlan
    models: int


def layouts_of(names: list[str], gpus: int) -> list[Layout]:
    """The layouts asked for that gpus allows (static2 needs 4 GPUs or more, an even number: said and left out)."""
    layouts = []
    for name in names:
        if name not in LAYOUTS:
            raise SystemExit(f"unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
        if name == "static2" and (gpus < 4 or gpus % 2):
            print(f"static2: skipped: it needs an even number of GPUs, 4 or more ({gpus} given)", flush=True)
            continue
        group = {"static1": 1, "static2": 2}.get(name, gpus)
        plan = plan_of(f"ulysses{group}") if group > 1 else ParallelPlan()
        layouts.append(Layout(name, replace(plan, elastic=name == "elastic"), gpus // group))
    return layouts


def copy_model(repository: Path, model: str, name: str, gpus: list[int]) -> None:
    """Another model of a built one's versions (their files hard-linked: the same weights are not built twice), its
    instances on `gpus` (GPU instances; CPU ones keep theirs)."""
    config = read_model_config(repository / model / "config.pbtxt")
    config.name = name
    group = config.instance_group[0]
    if group.gpus:
        del group.gpus[:]
        group.gpus.extend(gpus)
    for version in (repository / model).iterdir():
        if version.is_dir() and version.name.isdigit():
            shutil.copytree(version, repository / name / version.name, copy_function=os.link)
    write_model_config(repository / name / "config.pbtxt", config)


def build_layout(layout: Layout, repository: Path, pipeline_dir: Path, device: torch.device) -> list[str] | None:
    """Build the layout's models into the repository; their names, or None where the build cannot make it (said)."""
    names = [f"flux_{layout.name}_{number}" for number in range(layout.models)]
    data_type = "BF16" if device.type == "cuda" else "FP32"
    try:
        build_pipeline(repository, names[0], "flux-pipeline", pipeline_dir, data_type, device, layout.plan)
    except ValueError as error:
        print(f"{layout.name}: skipped: the build refused it: {error}", flush=True)
        return None
    size = layout.plan.world_size
    for number, name in enumerate(names[1:], start=1):
        copy_model(repository, names[0], name, list(range(number * size, (number + 1) * size)))
    return names


def warm_up(send, models: list[str], ranks: int, sizes: list[int]) -> list:
    """Every size on every model (the models at once): once per rank one after another, then once per rank at once;
    the outcomes."""
    def one_model(model: str) -> list:
        only = LeastBusy([model])
        outcomes = []
        for size in sizes:
            requests = [Request(size, 0)] * ranks
            outcomes += [timed(send, only, request) for request in requests]
            outcomes += run_closed_loop(send, only, requests, ranks)
        return outcomes

    with ThreadPoolExecutor(max_workers=len(models)) as pool:
        return [outcome for outcomes in pool.map(one_model, models) for outcome in outcomes]


@dataclass(frozen=True)
class Load:
    """What every layout is measured with (benchmarks/load.py's arguments)."""

    gpus: int
    sizes: list[int]
    steps: int
    loads: list[float]
    clients: int
    requests: int
    lone_repeats: int
    seed: int


def measure_layout(load: Load, layout: Layout, server, models: list[str], one_gpu_s: dict[int, float] | None,
                   record) -> dict[int, float]:
    """Warm the served layout up, then record its lone requests, each open-loop load and the closed-loop clients;
    return the sizes' one-GPU times (this layout's lone ones where none were known: static1's)."""
    prompt, guidance = REQUESTS["flux"]

    def send(model: str, request: Request) -> None:
        generate(server.grpc_address, model, prompt, request.size, request.size, load.steps, guidance, request.seed,
                 timeout=REQUEST_TIMEOUT_S)

    def measure(phase: str, outcomes_of, deadlines_s: dict[int, float] | None, **details) -> dict:
        before = job_seconds(server.metrics_url)
        outcomes = outcomes_of()
        busy_s = job_seconds(server.metrics_url) - before
        row = {"layout": layout.name, "phase": phase, "load": None, "clients": None, **details, "gpus": load.gpus,
               "steps": load.steps, "plan": str(layout.plan), "models": len(models), **summarize(outcomes, deadlines_s)}
        row["gpu_busy"] = busy_s / (load.gpus * row["wall_s"])
        errors = sorted({outcome.error for outcome in outcomes if outcome.error})
        if errors:
            print(f"{layout.name}, {phase}: {len(errors)} kind(s) of failure, e.g. {errors[0]}", flush=True)
        record(row)
        return row

    started = time.perf_counter()
    warmed = warm_up(send, models, layout.plan.world_size, load.sizes)
    print(f"{layout.name}: warm-up of {len(warmed)} requests in {time.perf_counter() - started:.0f} s, "
          f"{sum(outcome.error is not None for outcome in warmed)} failed", flush=True)
    deadlines_s = {size: 2 * one_gpu_s[size] for size in load.sizes} if one_gpu_s else None
    lone_requests = [Request(size, 0) for size in load.sizes for _ in range(load.lone_repeats)]
    lone = measure("lone", lambda: [timed(send, LeastBusy(models[:1]), request) for request in lone_requests],
                   deadlines_s)
    if one_gpu_s is None:
        one_gpu_s = {size: lone["sizes"][size]["p50_s"] for size in load.sizes}
        if None in one_gpu_s.values():
            raise SystemExit(f"{layout.name}: no lone request of some size was answered ({one_gpu_s}), so there is no "
                             "capacity or deadline to load against: see the server's log")
        deadlines_s = {size: 2 * one_gpu_s[size] for size in load.sizes}
    capacity = load.gpus / statistics.fmean(one_gpu_s[size] for size in load.sizes)
    print(f"{layout.name}: one-GPU lone seconds {one_gpu_s}: {load.gpus} one-GPU models serve {capacity:.2f} "
          "images/s", flush=True)
    for number, share_of_capacity in enumerate(load.loads):
        requests = poisson_requests(load.sizes, share_of_capacity * capacity, load.requests, load.seed + number)
        measure(f"open {share_of_capacity:g}", lambda: run_open_loop(send, LeastBusy(models), requests), deadlines_s,
                load=share_of_capacity)
    if load.clients:
        requests = mixed_requests(load.sizes, load.requests, load.seed + len(load.loads))
        measure(f"closed {load.clients}", lambda: run_closed_loop(send, LeastBusy(models), requests, load.clients),
                deadlines_s, clients=load.clients)
    return one_gpu_s


def seconds(value: float | None, form: str = "{:.3f}") -> str:
    return "-" if value is None else form.format(value)


def share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def layout_table(rows: list[dict]) -> str:
    """A layout's loads: a row of all its requests, then one per size."""
    cells = []
    for row in rows:
        for size, stats in [("all", row["all"]), *row["sizes"].items()]:
            whole = size == "all"
            cells.append([row["phase"] if whole else "", size, stats["requests"], stats["failed"],
                          seconds(row["images_per_s"], "{:.2f}") if whole else "", seconds(stats["mean_s"]),
                          seconds(stats["p50_s"]), seconds(stats["p99_s"]), share(stats["within_deadline"]),
                          share(row["gpu_busy"]) if whole else ""])
    return markdown_table(["load", "size", "requests", "failed", "images/s", "mean s", "p50 s", "p99 s",
                           "within 2x one GPU", "GPU busy"], cells)


def summary_table(rows: list[dict], sizes: list[int]) -> str:
    """Every layout in a row: its lone latency per size, then each load's throughput, mean and p99 latency and share
    within the deadline."""
    layouts = list(dict.fromkeys(row["layout"] for row in rows))
    loads = [phase for phase in dict.fromkeys(row["phase"] for row in rows) if phase != "lone"]
    cells = []
    for layout in layouts:
        by_phase = {row["phase"]: row for row in rows if row["layout"] == layout}
        lone = by_phase.get("lone", {}).get("sizes", {})
        line = [layout] + [seconds(lone[size]["p50_s"]) if size in lone else "-" for size in sizes]
        for phase in loads:
            row = by_phase.get(phase)
            line.append("-" if row is None else
                        f"{seconds(row['images_per_s'], '{:.2f}')} / {seconds(row['all']['mean_s'])} / "
                        f"{seconds(row['all']['p99_s'])} / {share(row['all']['within_deadline'])}")
        cells.append(line)
    return markdown_table(["layout", *(f"lone {size} s" for size in sizes),
                           *(f"{phase}: images/s / mean s / p99 s / within" for phase in loads)], cells)


def elastic_against_static(rows: list[dict], sizes: list[int]) -> list[str]:
    """The elastic layout's results as the ratios its targets are stated in: lone latency against staticN's,
    closed-loop throughput against static1's and staticN's, and each open-loop load's mean and p99 latency and share
    within the deadline against the best static layout's. Nothing without elastic rows."""
    by = {(row["layout"], row["phase"]): row for row in rows}
    phases = list(dict.fromkeys(row["phase"] for row in rows if row["layout"] == "elastic"))
    static = [layout for layout in dict.fromkeys(row["layout"] for row in rows) if layout != "elastic"]
    lines = []
    for phase in phases:
        elastic = by["elastic", phase]
        if phase == "lone" and ("staticN", phase) in by:
            ratios = [elastic["sizes"][size]["p50_s"] / by["staticN", phase]["sizes"][size]["p50_s"] for size in sizes
                      if elastic["sizes"][size]["p50_s"] and by["staticN", phase]["sizes"][size]["p50_s"]]
            lines.append("lone latency, elastic / staticN: " + ", ".join(f"{r:.3f}x" for r in ratios))
        elif phase.startswith("closed"):
            lines += [f"{phase} throughput, elastic / {layout}: "
                      f"{elastic['images_per_s'] / by[layout, phase]['images_per_s']:.3f}x"
                      for layout in static if (layout, phase) in by]
        elif phase != "lone" and any((layout, phase) in by for layout in static):
            others = [by[layout, phase]["all"] for layout in static if (layout, phase) in by]
            mean = min((o["mean_s"] for o in others if o["mean_s"] is not None), default=None)
            p99 = min((o["p99_s"] for o in others if o["p99_s"] is not None), default=None)
            within = max((o["within_deadline"] for o in others), default=None)
            mine = elastic["all"]
            lines.append(f"{phase}, elastic against the best static layout: mean {seconds(mine['mean_s'])} against "
                         f"{seconds(mean)} s, p99 {seconds(mine['p99_s'])} against {seconds(p99)} s, within the "
                         f"deadline {share(mine['within_deadline'])} against {share(within)}")
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Mean (solid) and p99 (dashed) latency against open-loop load, a colour per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    for layout in dict.fromkeys(row["layout"] for row in rows):
        points = sorted((row["load"], row["all"]["mean_s"], row["all"]["p99_s"]) for row in rows
                        if row["layout"] == layout and row["load"] is not None and row["all"]["mean_s"] is not None)
        if points:
            line, = axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{layout} mean")
            axis.plot([p[0] for p in points], [p[2] for p in points], marker="x", linestyle="--",
                      color=line.get_color(), label=f"{layout} p99")
    axis.set_title(title, fontsize="small", wrap=True)
    axis.set(xlabel="load (share of the one-GPU models' capacity)", ylabel="latency (s)")
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_one_gpu_seconds(text: str | None, sizes: list[int]) -> dict[int, float] | None:
    """--one-gpu-seconds SIZE=SECONDS,... as {size: seconds}, one for each of the sizes."""
    if text is None:
        return None
    given = {int(size): float(value) for size, value in (part.split("=") for part in text.split(","))}
    missing = [size for size in sizes if size not in given]
    if missing:
        raise SystemExit(f"--one-gpu-seconds has no time for size(s) {missing}: give SIZE=SECONDS for each of --sizes")
    return given


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny pipeline on CPU ranks, float32 (checks "
                                                            "the script)")
    parser.add_argument("--gpus", type=int, help="N, the GPUs every layout shares (default: every GPU; --tiny: 2 "
                                                 "CPU ranks)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"layouts in order, static1 first unless --one-gpu-seconds (default {','.join(LAYOUTS)})")
    parser.add_argument("--sizes", help="square image sizes in pixels, mixed at random (default 512,1024,1536; "
                                        "--tiny: 32,64,96)")
    parser.add_argument("--steps", type=int, help="denoising steps of every request (default 28; --tiny: 3)")
    parser.add_argument("--loads", default="0.5,0.8",
                        help="open-loop loads, as shares of the N one-GPU models' capacity (default 0.5,0.8)")
    parser.add_argument("--clients", type=int, default=8, help="closed-loop clients after the loads (default 8; 0: "
                                                               "none)")
    parser.add_argument("--requests", type=int, default=24, help="requests per load and for the clients (default 24)")
    parser.add_argument("--lone-repeats", type=int, default=3, help="lone requests per size (default 3)")
    parser.add_argument("--one-gpu-seconds", metavar="SIZE=S,...",
                        help="each size's lone one-GPU time, for the capacity and deadlines (default: static1's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sizes and arrivals (default 0)")
    parser.add_argument("--workdir", type=Path, help="the pipeline directory and model repository (default: a "
                                                     "temporary directory; FLUX.1-dev size needs about 45 GB)")
    parser.add_argument("--output", type=Path, help="append each load's row as JSON to this file")
    parser.add_argument("--plot", type=Path, help="draw latency against load per layout into this PNG file")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda:0")
    gpus = args.gpus or (2 if args.tiny else torch.cuda.device_count())
    if gpus < 1:
        raise SystemExit("no GPU visible: run on a GPU host, or with --tiny on CPU ranks")
    if args.requests < 1 or args.lone_repeats < 1 or args.clients < 0:
        raise SystemExit("give --requests and --lone-repeats of 1 or more, --clients of 0 or more")
    sizes = [int(size) for size in (args.sizes or ("32,64,96" if args.tiny else "512,1024,1536")).split(",")]
    steps = args.steps or (3 if args.tiny else 28)
    loads = [float(load) for load in args.loads.split(",")] if args.loads else []
    layouts = layouts_of(args.layouts.split(","), gpus)
    one_gpu_s = parse_one_gpu_seconds(args.one_gpu_seconds, sizes)
    if one_gpu_s is None and layouts and layouts[0].name != "static1":
        raise SystemExit("the capacity and deadlines come from static1's lone requests: put static1 first in "
                         "--layouts, or give --one-gpu-seconds")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - checked before hours of measuring
        except ImportError:
            raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    title = (f"FLUX pipeline ({'tiny' if args.tiny else 'FLUX.1-dev size'}), sizes {','.join(map(str, sizes))}, "
             f"{steps} steps, {gpus} {'CPU ranks' if args.tiny else 'GPUs'}, {device_name(device)}")
    load = Load(gpus, sizes, steps, loads, args.clients, args.requests, args.lone_repeats, args.seed)
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        if args.output:
            with args.output.open("a") as out:
                out.write(json.dumps(row) + "\n")

    with work_directory(args) as workdir:
        started = time.perf_counter()
        pipeline_dir, _ = flux_pipeline_dir(workdir / "pipeline", args.tiny, device)
        print(f"pipeline directory: {time.perf_counter() - started:.0f} s", flush=True)
        repository = workdir / "repository"
        for layout in layouts:
            started = time.perf_counter()
            models = build_layout(layout, repository, pipeline_dir, device)
            if models is None:
                continue
            built_s = time.perf_counter() - started
            try:
                with started_server(repository, workdir / f"server-{layout.name}.log", tuple(models)) as served:
                    server, ready_s = served
                    print(f"{layout.name}: {len(models)} model(s) of {layout.plan}: built in {built_s:.0f} s, ready "
                          f"in {ready_s:.0f} s", flush=True)
                    one_gpu_s = measure_layout(load, layout, server, models, one_gpu_s, record)
            except ServerError as error:
                print(f"{layout.name}: the server failed: {error}", flush=True)
            for model in models:  # the disk holds one layout at a time
                shutil.rmtree(repository / model)
            layout_rows = [row for row in rows if row["layout"] == layout.name]
            if layout_rows:
                print(f"\n{layout.name} ({len(models)} x {layout.plan}); {title}\n\n{layout_table(layout_rows)}\n",
                      flush=True)
    if not rows:
        return 1
    print(f"\n{title}; lone: median of {args.lone_repeats}; loads: {args.requests} requests, deadline twice the "
          f"size's one-GPU time\n\n{summary_table(rows, sizes)}\n")
    for line in elastic_against_static(rows, sizes):
        print(line)
    if args.plot:
        plot(rows, args.plot, title)
        print(f"wrote {args.plot}")
    return 0 if all(row["all"]["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
