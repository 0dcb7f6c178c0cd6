"""The 1-GPU peer of `mdtriton bench --architecture cosmos3`: diffusers' Cosmos3OmniTransformer at its default size
(cosmos3-15b: 15.2 B parameters; random bf16 weights, its time embedder in float32 as diffusers keeps it), eager
(torch's SDPA choice) and regionally compiled (its repeated decoder layers; cuDNN attention, as diffusers_wan.py), at
the same requests as the bench (Family.media_request: 256 text tokens and the latent video of 189 frames at 480p and
720p, packed as Cosmos3OmniPipeline packs them, timestep 500). Run it in the same device call as `mdtriton bench
--architecture cosmos3 --gpus 1`, so both are timed on one machine, by the same timer (mdtriton/harness.py). The first
call per size is printed apart from the median of the timed calls (a compile or a recompile shows there); the peak
memory allocated is each size's.

    python benchmarks/diffusers_cosmos3.py                      # 480p and 720p x 189 frames, eager and compiled
    python benchmarks/diffusers_cosmos3.py --tiny               # checks the script on the CPU
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import torch
from diffusers import Cosmos3OmniTransformer
from torch.nn.attention import SDPBackend, sdpa_kernel

from mdtriton.families.cosmos3 import COSMOS3
from mdtriton.harness import markdown_table, time_calls, timing


def diffusers_call(config: dict, request: dict[str, torch.Tensor]) -> dict:
    """diffusers' call of its transformer for our request, packed as Cosmos3OmniPipeline packs it: the text, then the
    video's tokens, every frame noisy."""
    latent = request["vision_tokens"]
    p = config["latent_patch_size"]
    grid = (latent.shape[2], -(-latent.shape[3] // p), -(-latent.shape[4] // p))
    text, video = request["input_ids"].shape[0], grid[0] * grid[1] * grid[2]
    device = latent.device
    return {"input_ids": request["input_ids"], "text_indexes": torch.arange(text, device=device),
            "position_ids": request["position_ids"], "und_len": text, "sequence_length": text + video,
            "vision_tokens": [latent], "vision_token_shapes": [grid],
            "vision_sequence_indexes": torch.arange(text, text + video, device=device),
            "vision_mse_loss_indexes": torch.arange(text, text + video, device=device),
            "vision_timesteps": request["timestep"].expand(video),
            "vision_noisy_frame_indexes": [torch.arange(grid[0], device=device)], "return_dict": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny Cosmos 3 on the CPU, 9 frames (checks the script)")
    parser.add_argument("--preset", default="cosmos3-15b", choices=sorted(COSMOS3.presets()))
    parser.add_argument("--height", default="480,720")
    parser.add_argument("--width", default="832,1280", help="one per height")
    parser.add_argument("--frames", type=int, default=189)
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--iterations", type=int, default=2, help="timed forwards after the first (default 2)")
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.height, args.width, args.frames = "tiny", "32", "48", 9
    device = torch.device("cpu" if args.tiny else "cuda")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = COSMOS3.presets()[args.preset]
    sizes = list(zip((int(n) for n in args.height.split(",")), (int(n) for n in args.width.split(","))))
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its type on the GPU: 15 B float32 parameters and a bf16 copy do not fit
    try:
        with device:
            model = Cosmos3OmniTransformer(**config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.time_embedder.float()  # diffusers' _keep_in_fp32_modules
    rows = []
    for mode in args.modes.split(","):
        if mode == "compile":
            model.compile_repeated_blocks(fullgraph=True)
        for height, width in sizes:
            request = {name: t.to(device) for name, t in COSMOS3.media_request(config, args.frames, height, width,
                                                                               dtype).items()}
            call = diffusers_call(config, request)
            backends = [SDPBackend.CUDNN_ATTENTION] if mode == "compile" and cuda else None
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            with torch.inference_mode(), (sdpa_kernel(backends) if backends else nullcontext()):
                first, _ = time_calls(lambda: model(**call), cuda, 0, 1)
                times, _ = time_calls(lambda: model(**call), cuda, 0, args.iterations)
            row = {"peer": f"diffusers {mode}", "size": f"{width}x{height} x {args.frames}",
                   "tokens": COSMOS3.check_request(config, request).tokens, "median_ms": timing(times)["median_ms"],
                   "first_call_s": first[0] / 1000,
                   "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(markdown_table(["peer", "size", "median ms", "first call s", "peak GiB"],
                         [[row["peer"], f"{row['size']} ({row['tokens']:,} tokens)", f"{row['median_ms']:,.0f}",
                           f"{row['first_call_s']:.1f}", f"{row['peak_gib']:.1f}"] for row in rows]))


if __name__ == "__main__":
    main()
