"""The 1-GPU peer of `mdtriton bench --architecture wan`: diffusers' WanTransformer3DModel at Wan 2.1 14B size (random
bf16 weights, batch 1), eager (torch's SDPA choice) and regionally compiled (cuDNN attention, as
../shared/bench/diffusers_wan_1gpu.py), at the same requests as the bench (Family.media_request: the latent video
of 81 frames at 480p and 720p, timestep 500, 512 text tokens). Run it in the same device call as
`mdtriton bench --architecture wan --gpus 1`, so both are timed on one machine, by the same timer
(mdtriton/harness.py). The first call per size is printed apart from the median of the timed calls (a compile or a
recompile shows there); the peak memory allocated is each size's.

    python benchmarks/diffusers_wan.py                          # 480p and 720p x 81 frames, eager and compiled
    python benchmarks/diffusers_wan.py --tiny                   # checks the script on the CPU
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import torch
from diffusers import WanTransformer3DModel
from torch.nn.attention import SDPBackend, sdpa_kernel

from mdtriton.families.wan import WAN
from mdtriton.harness import markdown_table, time_calls, timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny Wan on the CPU, 9 frames (checks the script)")
    parser.add_argument("--preset", default="wan2.1-t2v-14b", choices=sorted(WAN.presets()))
    parser.add_argument("--height", default="480,720")
    parser.add_argument("--width", default="832,1280", help="one per height")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--iterations", type=int, default=2, help="timed forwards after the first (default 2)")
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.height, args.width, args.frames = "tiny", "32", "48", 9
    device = torch.device("cpu" if args.tiny else "cuda")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = WAN.presets()[args.preset]
    sizes = list(zip((int(n) for n in args.height.split(",")), (int(n) for n in args.width.split(","))))
    torch.manual_seed(0)
    with device:
        model = WanTransformer3DModel(**{**config, "patch_size": tuple(config["patch_size"])}).to(dtype).eval()
    rows = []
    for mode in args.modes.split(","):
        if mode == "compile":
            model.compile_repeated_blocks(fullgraph=True)
        for height, width in sizes:
            request = {name: t.to(device) for name, t in WAN.media_request(config, args.frames, height, width,
                                                                           dtype).items()}
            backends = [SDPBackend.CUDNN_ATTENTION] if mode == "compile" and cuda else None
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            with torch.inference_mode(), (sdpa_kernel(backends) if backends else nullcontext()):
                first, _ = time_calls(lambda: model(**request, return_dict=False), cuda, 0, 1)
                times, _ = time_calls(lambda: model(**request, return_dict=False), cuda, 0, args.iterations)
            row = {"peer": f"diffusers {mode}", "size": f"{width}x{height} x {args.frames}",
                   "tokens": WAN.check_request(config, request).tokens, "median_ms": timing(times)["median_ms"],
                   "first_call_s": first[0] / 1000,
                   "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(markdown_table(["peer", "size", "median ms", "first call s", "peak GiB"],
                         [[row["peer"], f"{row['size']} ({row['tokens']:,} tokens)", f"{row['median_ms']:,.0f}",
                           f"{row['first_call_s']:.1f}", f"{row['peak_gib']:.1f}"] for row in rows]))


if __name__ == "__main__":
    main()
