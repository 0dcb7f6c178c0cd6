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

import torch
from diffusers import WanTransformer3DModel

from mdtriton.families.wan import WAN
from mdtriton.harness import peer_table, time_peer


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
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = WAN.presets()[args.preset]
    torch.manual_seed(0)
    with device:
        model = WanTransformer3DModel(**{**config, "patch_size": tuple(config["patch_size"])}).to(dtype).eval()
    calls = {}
    for height, width in zip((int(n) for n in args.height.split(",")), (int(n) for n in args.width.split(","))):
        request = {name: t.to(device) for name, t in WAN.media_request(config, args.frames, height, width,
                                                                       dtype).items()}
        calls[f"{width}x{height} x {args.frames}"] = ({**request, "return_dict": False},
                                                      WAN.check_request(config, request).tokens)
    print(peer_table(time_peer(model, args.modes.split(","), calls, device, args.iterations)))


if __name__ == "__main__":
    main()
