"""The 1-GPU peer: diffusers' FluxTransformer2DModel at FLUX.1-dev size (random bf16 weights, batch 1), eager and
with torch.compile of the whole model, cuDNN attention first as in our engine. Run it in the same device call as
`mdtriton bench --gpus 1`, so both are timed on one machine, by the same timer (mdtriton/harness.py). The first
compiled call per length compiles; its time is printed apart from the median of the timed calls.

    python benchmarks/diffusers_flux.py --image-tokens 4096,16384 --modes eager,compile
"""

from __future__ import annotations

import argparse
import json

import torch
from diffusers import FluxTransformer2DModel
from torch.nn.attention import SDPBackend, sdpa_kernel

from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG
from mdtriton.harness import flux_inputs, markdown_table, time_calls, timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image-tokens", default="4096,16384")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    with device:
        model = FluxTransformer2DModel(**{**FLUX_DEV_CONFIG, "axes_dims_rope": tuple(FLUX_DEV_CONFIG["axes_dims_rope"])})
    model = model.to(torch.bfloat16).eval()
    rows = []
    for mode in args.modes.split(","):
        forward = torch.compile(model) if mode == "compile" else model
        for image_tokens in [int(n) for n in args.image_tokens.split(",")]:
            inputs = flux_inputs(FLUX_DEV_CONFIG, args.text_tokens, image_tokens, device)
            with torch.inference_mode(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                first, _ = time_calls(lambda: forward(**inputs, return_dict=False), True, 0, 1)
                times, _ = time_calls(lambda: forward(**inputs, return_dict=False), True, args.warmup, args.iterations)
            row = {"peer": f"diffusers {mode}", "image_tokens": image_tokens, "text_tokens": args.text_tokens,
                   "median_ms": timing(times)["median_ms"], "first_call_s": first[0] / 1000}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(markdown_table(["peer", "image+text tokens", "median ms", "first call s"],
                         [[row["peer"], f"{row['image_tokens']:,}+{row['text_tokens']}", f"{row['median_ms']:.1f}",
                           f"{row['first_call_s']:.1f}"] for row in rows]))


if __name__ == "__main__":
    main()
