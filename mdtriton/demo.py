"""`mdtriton demo`: build a small engine, serve it on 2 CPU ranks (or every GPU), send requests, check them."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.client.grpc_client import Client, to_torch
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.server import TritonServer


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="build, serve and query a small multi-rank model end to end",
        description="Build a small tensor-parallel transformer engine, serve it with the embedded Triton server "
                    "on 2 CPU ranks (or on every GPU), send requests over gRPC, and check the answer against a "
                    "single-process reference computed from the same weights.")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"),
                        help="model repository to build into (default ./model_repository)")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: every GPU if there is one, else 2 CPU ranks")
    parser.add_argument("--ranks", type=int, help="number of ranks (default: every GPU, or 2 on CPU)")
    parser.add_argument("--requests", type=int, default=10, help="requests to time (default 10)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    device = args.device if args.device != "auto" else ("gpu" if torch.cuda.is_available() else "cpu")
    ranks = args.ranks or (torch.cuda.device_count() if device == "gpu" else 2)
    data_type = "BF16" if device == "gpu" else "FP32"
    config = {"hidden_size": 256, "num_heads": 8, "mlp_ratio": 4, "num_layers": 4}
    name = f"demo_{device}{ranks}"
    version_dir = build_model_version(args.repository, name, BuildRequest(
        "tiny_transformer", config, ParallelPlan(tp_size=ranks), data_type, device, seed=0))
    print(f"built {version_dir} (tiny_transformer, tensor-parallel over {ranks} {device.upper()} ranks, {data_type})")
    manifest = Manifest.read(version_dir / "engine")
    hidden_states = torch.randn(1, 128, config["hidden_size"], generator=torch.Generator().manual_seed(1))
    log_file = Path(tempfile.gettempdir()) / f"mdtriton-{name}-server.log"
    with TritonServer(args.repository, model_control_mode="explicit", load_models=(name,), log_file=log_file) as server:
        print(f"serving on gRPC {server.grpc_address} (server log: {log_file})")
        with Client(server.grpc_address) as client:
            latencies = []
            for _ in range(args.requests):
                start = time.perf_counter()
                outputs = client.infer(name, {"hidden_states": hidden_states}, version=version_dir.name)
                latencies.append(time.perf_counter() - start)
    answer = to_torch(outputs["output"]).float()
    reference_device = "cuda" if device == "gpu" else "cpu"
    reference = reference_module("tiny_transformer", manifest.config, random_weights("tiny_transformer", manifest.config, 0),
                                 data_type, reference_device)
    with torch.inference_mode():
        expected = reference(hidden_states.to(reference_device, reference.norm_out.weight.dtype))["output"].float().cpu()
    error = ((answer - expected).abs().max() / expected.abs().max()).item()
    print(f"output: {list(answer.shape)}, first values {answer.flatten()[:4].tolist()}")
    print(f"max relative error vs 1-rank reference: {error:.2e}")
    print(f"latency over {args.requests} requests: median {statistics.median(latencies) * 1000:.1f} ms, "
          f"first {latencies[0] * 1000:.1f} ms")
    return 0
