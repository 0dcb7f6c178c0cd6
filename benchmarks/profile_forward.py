"""Where a 1-GPU forward of a family's transformer spends its GPU time, by kernel kind: ours (compiled, eager or FP8,
loaded as the server loads it: mdtriton/harness.py) or diffusers' (eager, or its repeated blocks compiled with cuDNN
attention, as benchmarks/diffusers_peer.py runs it), random bf16 weights, one request of the bench's (the first size
of --height/--width/--frames). Prints the forward's time (the median of 3 after 2), then, from one more forward under
the profiler, the time per kernel kind (NCCL, attention, GEMMs, Inductor's fused Triton kernels, copies, other) and the
largest kernels. --config '{"num_hidden_layers": 6}' (or FLUX's num_layers) profiles fewer layers of the published
width: the per-layer mix is the same, the compile shorter.

    python benchmarks/profile_forward.py --architecture flux --height 1024 --width 1024
    python benchmarks/profile_forward.py --architecture cosmos3 --impl diffusers --height 720 --width 1280
    python benchmarks/profile_forward.py --architecture wan --device cpu --preset tiny --height 32 --width 48 --frames 9
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from diffusers_peer import PEERS, peer_model
from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import family
from mdtriton.harness import (add_model_arguments, bench_engine, bench_weights, kind_of, markdown_table, model_config,
                              model_sizes, precision, time_calls)


def forward_of(args: argparse.Namespace, config: dict, request: dict[str, torch.Tensor], device: torch.device):
    """The forward to profile: a function of no arguments."""
    dtype, data_type = precision(device)
    if args.impl == "diffusers":
        model = peer_model(args.architecture, config, device, dtype)
        if args.variant == "compiled":
            model.compile_repeated_blocks(fullgraph=True)
        keywords = PEERS[args.architecture][1](config, request)
        cudnn = args.variant == "compiled" and device.type == "cuda"

        def forward():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if cudnn else nullcontext():
                return model(**keywords)
        return forward
    quantization = "fp8" if args.variant == "fp8" else None
    weights = bench_weights(args.architecture, config, ParallelPlan(), 0, device, dtype, quantization)
    engine = bench_engine(args.architecture, config, Communicator.single(device), weights, data_type, quantization,
                          compiled=args.variant != "eager")
    return lambda: engine.forward(request)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, list(PEERS))
    parser.add_argument("--impl", choices=("mdtriton", "diffusers"), default="mdtriton")
    parser.add_argument("--variant", choices=("compiled", "eager", "fp8"), default="compiled",
                        help="compiled (default), eager, or fp8 (ours only)")
    parser.add_argument("--top", type=int, default=25, help="the largest kernels listed (default 25)")
    args = parser.parse_args()
    if args.impl == "diffusers" and args.variant == "fp8":
        parser.error("--variant fp8 is ours only; diffusers runs compiled or eager")
    config = model_config(args)
    size = model_sizes(args, config)[0]
    device = torch.device(args.device)
    dtype, _ = precision(device)
    request = {name: tensor.to(device) for name, tensor in
               family(args.architecture).media_request(config, size.frames, size.height, size.width, dtype).items()}
    torch.manual_seed(0)
    forward = forward_of(args, config, request, device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with torch.inference_mode():
        times, _ = time_calls(forward, cuda, 2, 3)
        with profile(activities=activities) as profiler:
            forward()
            if cuda:
                torch.cuda.synchronize()
    # On CPU (checking the script) the operators' own CPU time stands in for kernels.
    kernels = [e for e in profiler.key_averages() if (e.device_type.name == "CUDA") == cuda]

    def ms(event) -> float:
        return (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1000

    total = sum(ms(event) for event in kernels)
    by_kind = defaultdict(float)
    for event in kernels:
        by_kind[kind_of(event.key)] += ms(event)
    layers = config.get("num_hidden_layers", config.get("num_layers"))
    print(f"{args.architecture} {args.impl} {args.variant}, {size}, {layers} layers: a forward in "
          f"{statistics.median(times):.1f} ms (median of 3), {total:.1f} ms of kernels in the profiled one")
    print(markdown_table(["kind", "ms", "share"], [[kind, f"{t:.1f}", f"{100 * t / total:.0f}%"]
                                                   for kind, t in sorted(by_kind.items(), key=lambda item: -item[1])]))
    print(markdown_table(["kernel", "kind", "calls", "ms"],
                         [[event.key[:100], kind_of(event.key), event.count, f"{ms(event):.2f}"]
                          for event in sorted(kernels, key=lambda e: -ms(e))[:args.top]]))


if __name__ == "__main__":
    main()
