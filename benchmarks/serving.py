"""What serving adds: one FLUX forward through Triton (gRPC, our client) against the same engine called directly.

Builds a FLUX engine (random weights generated on the GPU) into a model repository, serves it with the
embedded Triton server and times sequential requests, then concurrent ones; then stops the server,
loads the same engine files in one process per rank (compiling from the cache the server's load left in the
engine directory) and times `engine.forward` with CUDA events.
Prints a table and writes it as JSON. GPUs only.

    python benchmarks/serving.py --tp 2 --image-tokens 16384
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mdtriton.bench import flux_inputs, time_calls
from mdtriton.build_tools.build import build_model_version
from mdtriton.client.grpc_client import Client
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.models.flux import Flux
from mdtriton.engine.plan import CP_METHODS, ParallelPlan
from mdtriton.server import TritonServer, free_port

MODEL = "flux"


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def served_latencies(address: str, inputs: dict, requests: int, concurrency: int) -> tuple[list[float], float]:
    """Milliseconds of each request (sent by `concurrency` clients at once) and the requests per second."""

    def ask(_):
        with Client(address, timeout=600) as client:
            start = time.perf_counter()
            client.infer(MODEL, inputs)
            return (time.perf_counter() - start) * 1000

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(ask, range(requests)))
    return latencies, requests / (time.perf_counter() - began)


def _engine_rank(rank: int, world_size: int, port: int, engine_dir: str, inputs: dict, args, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    manifest = Manifest.read(engine_dir)
    comm = Communicator(manifest.plan, rank, device)
    comm.join_groups()
    engine = TorchEngine.load(engine_dir, manifest, comm)
    on_device = {name: tensor.to(device) for name, tensor in inputs.items()}
    times, _ = time_calls(lambda: engine.forward(on_device), True, args.warmup, args.requests)
    if rank == 0:
        Path(result_path).write_text(json.dumps({"times": times, "load_s": engine.load_seconds,
                                                 "warm_up_s": engine.warm_up_seconds}))
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="flux.1-dev", choices=sorted(Flux.presets()))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--cp-method", default="allgather_kv", choices=CP_METHODS)
    parser.add_argument("--image-tokens", type=int, default=16384)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=10, help="timed requests per measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4, help="clients at once in the throughput run")
    parser.add_argument("--repository", type=Path, help="model repository to build into (default: a temporary one)")
    parser.add_argument("--output", type=Path, default=Path("bench-results/serving.json"))
    args = parser.parse_args()

    plan = ParallelPlan(args.tp, args.cp, args.cp_method)
    config = Flux.presets()[args.preset]
    with tempfile.TemporaryDirectory() as scratch:
        repository = args.repository or Path(scratch)
        start = time.perf_counter()
        version_dir = build_model_version(repository, MODEL, "flux", config, plan, "BF16", "gpu",
                                          random_device="cuda")
        build_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()  # the ranks need the memory the build's generator used
        inputs = {name: tensor.cpu() for name, tensor in
                  flux_inputs(config, args.text_tokens, args.image_tokens, torch.device("cuda")).items()}
        start = time.perf_counter()
        with TritonServer(repository, log_file=Path(scratch) / "server.log") as server:
            ready_seconds = time.perf_counter() - start
            served_latencies(server.grpc_address, inputs, args.warmup, 1)
            sequential, _ = served_latencies(server.grpc_address, inputs, args.requests, 1)
            concurrent, throughput = served_latencies(server.grpc_address, inputs, 2 * args.requests, args.concurrency)
        result_path = Path(scratch) / "engine.json"
        mp.spawn(_engine_rank, args=(plan.world_size, free_port(), str(version_dir / "engine"), inputs, args,
                                     str(result_path)), nprocs=plan.world_size)
        direct = json.loads(result_path.read_text())

    engine_ms, served_ms = statistics.median(direct["times"]), statistics.median(sequential)
    rows = {"plan": str(plan), "image_tokens": args.image_tokens, "text_tokens": args.text_tokens,
            "build_s": build_seconds, "server_start_to_ready_s": ready_seconds,
            "cached_load_s": direct["load_s"], "cached_warm_up_s": direct["warm_up_s"],
            "engine_median_ms": engine_ms, "grpc_median_ms": served_ms, "overhead": served_ms / engine_ms - 1,
            "concurrency": args.concurrency, "concurrent_p50_ms": percentile(concurrent, 0.5),
            "concurrent_p99_ms": percentile(concurrent, 0.99), "throughput_per_s": throughput}
    print(f"| plan | tokens | engine median ms | gRPC median ms | overhead | {args.concurrency} clients: p50 / p99 ms "
          "| requests/s | build s | start to ready s (compiling) | load + warm-up s (compile cache) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {plan} | {args.image_tokens:,}+{args.text_tokens} | {engine_ms:.1f} | {served_ms:.1f} | "
          f"{100 * rows['overhead']:+.1f}% | {rows['concurrent_p50_ms']:.0f} / {rows['concurrent_p99_ms']:.0f} | "
          f"{throughput:.2f} | {build_seconds:.0f} | {ready_seconds:.0f} | {direct['load_s']:.0f} + "
          f"{direct['warm_up_s']:.0f} |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
