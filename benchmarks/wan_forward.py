"""One Wan transformer forward on one GPU: ours (bf16, FP8) against diffusers' WanTransformer3DModel (eager, and
regional torch.compile), at 480p and 720p x 81 frames, in one process.

Ours is loaded the way the server loads it (the benchmark harness, mdtriton/harness.py: TorchEngine.from_weights,
the module, then its compile and warm-up at two request shapes), with random weights made on the GPU from one seed;
diffusers' model gets its own random weights (the same sizes; random weights time the same as trained ones). Inputs
as WanPipeline makes them: the latent video [1, 16, 21, H/8, W/8], timestep 500, 512 text tokens. Times: the
harness's timer (CUDA events) around whole forwards, the median of --iterations after the first call at each size
(reported apart: a recompile would show there); peak memory allocated during each size.

    python benchmarks/wan_forward.py                                  # Wan 2.1 14B, 480p and 720p, one GPU
    python benchmarks/wan_forward.py --tiny                           # checks the script on the CPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mdtriton.build_tools.engine_builder import random_shard  # noqa: E402
from mdtriton.engine.comm import Communicator  # noqa: E402
from mdtriton.engine.plan import ParallelPlan  # noqa: E402
from mdtriton.families.wan import WAN  # noqa: E402
from mdtriton.harness import bench_engine, markdown_table, time_calls  # noqa: E402

# (label, height, width) of the videos; 81 frames each (5 s at 16 fps).
SIZES = {"480p": (480, 832), "720p": (720, 1280)}
FRAMES = 81


def video_inputs(config: dict, height: int, width: int, frames: int, device: torch.device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    latent = ((frames - 1) // 4 + 1, height // 8, width // 8)
    return {name: tensor.to(device) for name, tensor in WAN.inputs(config, latent, 512, dtype).items()}


def timed(call, device: torch.device, iterations: int) -> tuple[float, list[float], float]:
    """(seconds of the first call, seconds of each later one, peak GiB allocated), by the harness's timer."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    first, _ = time_calls(call, cuda, 0, 1)
    times, _ = time_calls(call, cuda, 0, iterations)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    return first[0] / 1000, [ms / 1000 for ms in times], peak


def ours(args, config: dict, device: torch.device, quantization: str | None) -> dict:
    """Our engine as the server loads it: {size: (first, times, peak)} and the load's seconds."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    data_type = "FP32" if device.type == "cpu" else "BF16"
    start = time.perf_counter()
    weights = random_shard("wan", config, ParallelPlan(), 0, seed=0, device=device, dtype=dtype,
                           quantization=quantization)
    made = time.perf_counter() - start
    engine = bench_engine("wan", config, Communicator.single(device), weights, data_type, quantization)
    print(f"ours ({quantization or data_type}): weights made in {made:.0f} s, loaded in {engine.load_seconds:.1f} s, "
          f"compiled and warmed up in {engine.warm_up_seconds:.0f} s", flush=True)
    results = {}
    for label in args.sizes:
        request = video_inputs(config, *SIZES[label], args.frames, device, dtype)
        results[label] = timed(lambda: engine.forward(request), device, args.iterations)
        print(f"  {label}: {statistics.median(results[label][1]) * 1000:,.0f} ms", flush=True)
    return results


def diffusers_peer(args, config: dict, device: torch.device) -> dict[str, dict]:
    """diffusers' model, eager (torch's SDPA choice) and regionally compiled (cuDNN attention, as
    ../shared/bench/diffusers_wan_1gpu.py): {mode: {size: (first, times, peak)}}."""
    from diffusers import WanTransformer3DModel

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    start = time.perf_counter()
    with torch.device(device):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**{**config, "patch_size": tuple(config["patch_size"])}).to(dtype).eval()
    print(f"diffusers: model made in {time.perf_counter() - start:.0f} s", flush=True)
    results = {}
    for mode in args.peers:
        if mode == "compile":
            model.compile_repeated_blocks(fullgraph=True)
        results[mode] = {}
        for label in args.sizes:
            request = video_inputs(config, *SIZES[label], args.frames, device, dtype)
            backends = [SDPBackend.CUDNN_ATTENTION] if mode == "compile" and device.type == "cuda" else None
            with torch.inference_mode(), (sdpa_kernel(backends) if backends else nullcontext()):
                results[mode][label] = timed(lambda: model(**request, return_dict=False), device, args.iterations)
            print(f"  diffusers {mode} {label}: {statistics.median(results[mode][label][1]) * 1000:,.0f} ms", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny Wan on the CPU, 9 frames (checks the script)")
    parser.add_argument("--preset", default="wan2.1-t2v-14b", choices=sorted(WAN.presets()))
    parser.add_argument("--sizes", default="480p,720p", help="comma-separated: 480p, 720p (default both)")
    parser.add_argument("--frames", type=int, default=FRAMES, help=f"frames, 4k+1 (default {FRAMES})")
    parser.add_argument("--variants", default="bf16,fp8", help="ours: bf16, fp8 (default both)")
    parser.add_argument("--peers", default="eager,compile", help="diffusers: eager, compile, or none")
    parser.add_argument("--iterations", type=int, default=2, help="timed forwards after the first (default 2)")
    args = parser.parse_args()
    args.sizes = args.sizes.split(",")
    args.peers = [] if args.peers == "none" else args.peers.split(",")
    device = torch.device("cpu" if args.tiny else "cuda:0")
    config = WAN.presets()["tiny" if args.tiny else args.preset]
    if args.tiny:
        SIZES.update({"480p": (32, 48), "720p": (48, 64)})
        args.frames = 9

    rows = {}
    for variant in args.variants.split(","):
        rows[f"mdtriton {variant}"] = ours(args, config, device, "fp8" if variant == "fp8" else None)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.peers:
        for mode, results in diffusers_peer(args, config, device).items():
            rows[f"diffusers {mode}"] = results

    where = "CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"\n{'tiny Wan' if args.tiny else args.preset}, {args.frames} frames, batch 1, 512 text tokens, {where}, "
          f"torch {torch.__version__}; median of {args.iterations} forwards after the first\n")
    baseline = rows.get("diffusers compile")
    tokens = {label: WAN.check_request(config, video_inputs(config, *SIZES[label], args.frames, torch.device("meta"),
                                                             torch.float32)).tokens for label in args.sizes}
    table = []
    for name, results in rows.items():
        cells = [name]
        for label in args.sizes:
            median = statistics.median(results[label][1])
            ratio = f" ({median / statistics.median(baseline[label][1]):.2f}x)" if baseline else ""
            cells.append(f"{median * 1000:,.0f} ms{ratio}")
        cells.append(" / ".join(f"{results[label][0]:.1f} s" for label in args.sizes))
        cells.append(f"{max(results[label][2] for label in args.sizes):.2f} GiB")
        table.append(cells)
    print(markdown_table(["forward", *(f"{label} ({tokens[label]:,} tokens)" for label in args.sizes), "first call",
                          "peak"], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
