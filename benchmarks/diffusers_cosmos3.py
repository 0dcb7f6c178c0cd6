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

import torch
from diffusers import Cosmos3OmniTransformer

from mdtriton.families.cosmos3 import COSMOS3
from mdtriton.harness import peer_table, time_peer


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
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = COSMOS3.presets()[args.preset]
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its type on the GPU: 15 B float32 parameters and a bf16 copy do not fit
    try:
        with device:
            model = Cosmos3OmniTransformer(**config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.time_embedder.float()  # diffusers' _keep_in_fp32_modules
    calls = {}
    for height, width in zip((int(n) for n in args.height.split(",")), (int(n) for n in args.width.split(","))):
        request = {name: t.to(device) for name, t in COSMOS3.media_request(config, args.frames, height, width,
                                                                           dtype).items()}
        calls[f"{width}x{height} x {args.frames}"] = (diffusers_call(config, request),
                                                      COSMOS3.check_request(config, request).tokens)
    print(peer_table(time_peer(model, args.modes.split(","), calls, device, args.iterations)))


if __name__ == "__main__":
    main()
