"""A model that does not fit one GPU, served across several: refuse, build, serve, check, time.

Uses the FLUX architecture scaled to 80 B parameters (preset flux-80b: 160 GB in bf16, more than one
H200's 141 GB). It shows that the model built for one GPU is refused before anything is written; builds
it with tensor parallelism over --tp GPUs (random weights generated on the GPU, written rank by rank);
serves it with the embedded Triton server (load time, memory per GPU); times requests over gRPC; and
compares the answer with a second path: the model re-assembled from the rank files and run on one GPU
in float32, one block at a time. Prints a table and writes JSON. GPUs only; needs about 170 GB of disk.

    python benchmarks/large_model.py --tp 4 --repository /big/disk/model_repository
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.reassemble import streamed_reference
from mdtriton.client.grpc_client import Client, to_torch
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.harness import flux_inputs
from mdtriton.server import TritonServer

MODEL = "flux_large"


def gpu_memory_used_gib() -> list[float]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [int(line) / 1024 for line in out.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="flux-80b", choices=sorted(FLUX.presets()))
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--repository", type=Path, required=True, help="model repository on a disk with room")
    parser.add_argument("--keep", action="store_true", help="keep the built engine (default: delete it at the end)")
    parser.add_argument("--output", type=Path, default=Path("bench-results/large_model.json"))
    args = parser.parse_args()

    config = FLUX.presets()[args.preset]
    result = {"preset": args.preset, "tp": args.tp, "image_tokens": args.image_tokens, "text_tokens": args.text_tokens}
    try:
        build_model_version(args.repository, f"{MODEL}_1gpu", "flux", config, ParallelPlan(), "BF16", "gpu",
                            gpus=[0], random_device="cuda")
        result["one_gpu_refusal"] = None
    except EngineError as error:
        result["one_gpu_refusal"] = str(error)
    print(f"built for one GPU: {result['one_gpu_refusal'] or 'NOT refused'}", flush=True)

    start = time.perf_counter()
    version_dir = build_model_version(args.repository, MODEL, "flux", config, ParallelPlan(tp_size=args.tp), "BF16",
                                      "gpu", random_device="cuda")
    result["build_s"] = time.perf_counter() - start
    torch.cuda.empty_cache()
    result["engine_gb"] = sum(f.stat().st_size for f in (version_dir / "engine").iterdir()) / 1e9
    print(f"built {result['engine_gb']:.0f} GB in {result['build_s']:.0f} s", flush=True)

    inputs = {name: tensor.cpu() for name, tensor in
              flux_inputs(config, args.text_tokens, args.image_tokens, torch.device("cuda")).items()}
    start = time.perf_counter()
    log_file = args.repository / "server.log"
    with TritonServer(args.repository, model_control_mode="explicit", load_models=(MODEL,), log_file=log_file) as server:
        result["load_to_ready_s"] = time.perf_counter() - start
        result["gpu_memory_used_gib"] = gpu_memory_used_gib()
        latencies = []
        with Client(server.grpc_address, timeout=900) as client:
            for _ in range(args.requests + 1):
                began = time.perf_counter()
                sample = to_torch(client.infer(MODEL, inputs)["sample"])
                latencies.append((time.perf_counter() - began) * 1000)
    result["first_request_ms"], result["median_request_ms"] = latencies[0], statistics.median(latencies[1:])
    print(f"served: ready in {result['load_to_ready_s']:.0f} s, median request {result['median_request_ms']:.0f} ms",
          flush=True)

    reference = streamed_reference(version_dir / "engine", "cuda:0", torch.float32)
    start = time.perf_counter()
    with torch.inference_mode():
        expected = reference(**{name: t.to("cuda:0", torch.float32) for name, t in inputs.items()})["sample"].cpu()
    result["reference_s"] = time.perf_counter() - start
    result["relative_error_vs_float32_reference"] = ((sample.float() - expected).norm() / expected.norm()).item()
    if not args.keep:
        shutil.rmtree(args.repository / MODEL)

    print("| model | GPUs | engine GB | 1-GPU build | build s | load to ready s | GiB used per GPU | "
          "median request ms | rel. error vs float32 streamed reference |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.preset} | {args.tp} | {result['engine_gb']:.0f} | "
          f"{'refused' if result['one_gpu_refusal'] else 'NOT refused'} | {result['build_s']:.0f} | "
          f"{result['load_to_ready_s']:.0f} | {', '.join(f'{m:.0f}' for m in result['gpu_memory_used_gib'])} | "
          f"{result['median_request_ms']:.0f} | {result['relative_error_vs_float32_reference']:.1e} |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
