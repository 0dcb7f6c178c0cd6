"""perf_analyzer against a served FLUX transformer: build, serve, measure, stop.

Builds a FLUX engine with FLUX.1-dev's widths (random weights, fewer blocks unless --layers/--single-layers
say otherwise) on --ranks GPUs, serves it with the embedded Triton server, runs perf_analyzer for one
1024 x 1024 denoising step (4096 image tokens, 512 text tokens) with the tensors in gRPC messages, in system
shared memory and (GPU) in CUDA shared memory, and prints perf_analyzer's summary line for each. Shared memory
is measured over HTTP: the server takes it only with its key (client/server_key.py), which perf_analyzer sends
as a header over HTTP only.

    python3 benchmarks/install_perf_analyzer.py          # once
    python3 benchmarks/perf_analyzer_flux.py --ranks 2 --cp-method ring
    python3 benchmarks/perf_analyzer_flux.py --device cpu --tiny --image-tokens 64 --text-tokens 16 \
        --stability-percentage 100        # the same path on CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.server_key import RESTRICTED_KEY
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG, TINY_CONFIG
from mdtriton.harness import started_server


def shapes(config: dict, image_tokens: int, text_tokens: int) -> list[str]:
    axes = len(config["axes_dims_rope"])
    dims = {"hidden_states": [1, image_tokens, config["in_channels"]],
            "encoder_hidden_states": [1, text_tokens, config["joint_attention_dim"]],
            "pooled_projections": [1, config["pooled_projection_dim"]], "timestep": [1], "guidance": [1],
            "img_ids": [image_tokens, axes], "txt_ids": [text_tokens, axes]}
    return [f"{name}:{','.join(map(str, d))}" for name, d in dims.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cp-method", default="ring", choices=("allgather_kv", "ring", "ulysses", "tp"),
                        help="context-parallel method, or tp for tensor parallelism")
    parser.add_argument("--layers", type=int, default=2, help="double-stream blocks (FLUX.1-dev: 19)")
    parser.add_argument("--single-layers", type=int, default=4, help="single-stream blocks (FLUX.1-dev: 38)")
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--tiny", action="store_true", help="the tiny test FLUX (for trying this script on CPU)")
    parser.add_argument("--concurrency", default="1:2")
    parser.add_argument("--stability-percentage", default="10",
                        help="perf_analyzer's allowed spread between windows (raise it on a busy machine)")
    args = parser.parse_args()

    config = dict(TINY_CONFIG if args.tiny else FLUX_DEV_CONFIG)
    config.update(num_layers=args.layers, num_single_layers=args.single_layers)
    plan = (ParallelPlan(tp_size=args.ranks) if args.cp_method == "tp"
            else ParallelPlan(cp_size=args.ranks, cp_method=args.cp_method))
    data_type = "BF16" if args.device == "gpu" else "FP32"
    perf_analyzer = str(Path(sysconfig.get_paths()["scripts"]) / "perf_analyzer")
    transports = ["none", "system"] + (["cuda"] if args.device == "gpu" else [])
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "repository"
        build_model_version(repository, "flux", BuildRequest("flux", config, plan, data_type, args.device, seed=0))
        print(f"# flux, widths of {'tiny' if args.tiny else 'FLUX.1-dev'}, {args.layers}+{args.single_layers} blocks, "
              f"{plan}, {data_type}, {args.image_tokens} image + {args.text_tokens} text tokens", flush=True)
        with started_server(repository, Path(tmp) / "server.log") as (server, _):
            for transport in transports:
                # Output: [1, image_tokens, in_channels] in the engine's data type.
                output_bytes = args.image_tokens * config["in_channels"] * (2 if data_type == "BF16" else 4)
                protocol = (["-u", server.grpc_address, "-i", "grpc"] if transport == "none" else
                            ["-u", server.http_address, "-i", "http", "-H", f"{RESTRICTED_KEY}:{server.key}"])
                command = [perf_analyzer, "-m", "flux", *protocol,
                           "--concurrency-range", args.concurrency, "--shared-memory", transport,
                           # perf_analyzer's default random bytes hold NaNs, which the model refuses.
                           "--input-data", "zero",
                           "--output-shared-memory-size", str(output_bytes),
                           "--measurement-mode", "count_windows", "--measurement-request-count", "20",
                           "--stability-percentage", args.stability_percentage]
                for shape in shapes(config, args.image_tokens, args.text_tokens):
                    command += ["--shape", shape]
                result = subprocess.run(command, capture_output=True, text=True)
                lines = re.findall(r"^Concurrency: .*$", result.stdout, flags=re.MULTILINE)
                if result.returncode != 0 or not lines:
                    print(f"{transport}: perf_analyzer failed ({result.returncode}):\n{result.stdout[-2000:]}"
                          f"{result.stderr[-2000:]}", file=sys.stderr)
                    return 1
                for line in lines:
                    print(f"shared memory {transport}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
