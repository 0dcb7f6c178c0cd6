"""The peer of `mdtriton bench`: diffusers' own transformer of the family (FluxTransformer2DModel,
WanTransformer3DModel, Cosmos3OmniTransformer) at the preset's size (random weights, batch 1, made in bf16 on the GPU;
Cosmos 3's time embedder in float32, as diffusers keeps it), at the bench's requests (Family.media_request at the sizes
in pixels; Cosmos 3's packed as Cosmos3OmniPipeline packs them), eager (torch's SDPA choice) and regionally compiled
(its repeated blocks, `compile_repeated_blocks(fullgraph=True)`, cuDNN attention); on one GPU, or with --gpus N on
N GPUs with diffusers' own context parallelism (`enable_parallelism(ContextParallelConfig(ulysses_degree=N))`, or
ring_degree with --cp-method ring; cuDNN attention, one process per GPU). Wan 2.1 I2V (--preset wan2.1-i2v-14b) is
called with its image encoder's 257 tokens beside the 512 text tokens. It takes the bench's model
arguments (mdtriton/harness.py: --architecture, --preset, --config, --height, --width, --frames, --device). Run it
on the same machine as `mdtriton bench --architecture NAME --gpus 1` (on another GPU of it, at the same time, or
right after), so both are timed on one machine, by the same timer. The first call per size is printed apart from the
median of the timed calls (a compile or a recompile shows there); the peak memory allocated is each size's.

    python benchmarks/diffusers_peer.py --architecture flux --height 1024,2048 --width 1024,2048
    python benchmarks/diffusers_peer.py --architecture wan          # 480p and 720p x 81 frames
    python benchmarks/diffusers_peer.py --architecture wan --preset wan2.1-i2v-14b --height 720 --width 1280 --gpus 2
    python benchmarks/diffusers_peer.py --architecture cosmos3      # 480p and 720p x 189 frames
    python benchmarks/diffusers_peer.py --architecture wan --device cpu --preset tiny --height 32 --width 48 --frames 9
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from mdtriton.families import family
from mdtriton.harness import (add_model_arguments, init_rank, markdown_table, model_config, model_sizes, precision,
                              run_ranks, time_calls, timing)


def flux_model(config: dict) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(**{**config, "axes_dims_rope": tuple(config["axes_dims_rope"])})


def wan_model(config: dict) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**{**config, "patch_size": tuple(config["patch_size"])})


def cosmos3_model(config: dict) -> torch.nn.Module:
    from diffusers import Cosmos3OmniTransformer

    model = Cosmos3OmniTransformer(**config)
    model.time_embedder.float()  # diffusers' _keep_in_fp32_modules
    return model


def keywords(config: dict, request: dict[str, torch.Tensor]) -> dict:
    """diffusers' call of FLUX's or Wan's transformer for our request: the same names."""
    return {**request, "return_dict": False}


def cosmos3_keywords(config: dict, request: dict[str, torch.Tensor]) -> dict:
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


# architecture: (diffusers' transformer of a config, its keyword arguments for one of our requests)
PEERS = {"flux": (flux_model, keywords), "wan": (wan_model, keywords), "cosmos3": (cosmos3_model, cosmos3_keywords)}


def peer_model(architecture: str, config: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """diffusers' transformer of the architecture at config, made on device in dtype (a float32 copy of 12-15 B
    parameters beside it would not fit), in eval mode."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return PEERS[architecture][0](config).eval()
    finally:
        torch.set_default_dtype(previous)


def time_peer(model: torch.nn.Module, modes: list[str], calls: dict[str, tuple[dict, int]], device: torch.device,
              iterations: int) -> list[dict]:
    """In each mode (eager: torch's SDPA choice; compile: the repeated blocks compiled, cuDNN attention), each size's
    call (its label: diffusers' keyword arguments and the request's tokens) timed by the harness's timer: the first call
    apart (a compile shows there), the median of `iterations` later ones, the peak memory allocated meanwhile. Each row
    is printed as JSON as it is measured."""
    cuda = device.type == "cuda"
    rows = []
    for mode in modes:
        if mode == "compile":
            model.compile_repeated_blocks(fullgraph=True)
        for label, (arguments, tokens) in calls.items():
            backends = sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if mode == "compile" and cuda else nullcontext()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            with torch.inference_mode(), backends:
                first, _ = time_calls(lambda: model(**arguments), cuda, 0, 1)
                times, _ = time_calls(lambda: model(**arguments), cuda, 0, iterations)
            parallel = f" {parallel_label(model)}" if getattr(model, "_parallel_config", None) else ""
            row = {"peer": f"diffusers {mode}{parallel}", "size": label, "tokens": tokens,
                   "median_ms": timing(times)["median_ms"], "first_call_s": first[0] / 1000,
                   "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0}
            rows.append(row)
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
    return rows


def parallel_label(model: torch.nn.Module) -> str:
    """The context parallelism diffusers runs the model with, e.g. "ulysses 2"."""
    config = model._parallel_config.context_parallel_config
    return " x ".join(f"{kind} {getattr(config, f'{kind}_degree')}" for kind in ("ulysses", "ring")
                      if (getattr(config, f"{kind}_degree") or 1) > 1)


def rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """One rank of the peer: the model made from seed 0 (the same on every rank), split by diffusers' own context
    parallelism over world_size ranks (NCCL on GPUs, gloo on CPU), timed at every size; rank 0 prints the table."""
    device = init_rank(rank, world_size, port, args.device == "cuda")
    config = model_config(args)
    model_family = family(args.architecture)
    dtype, _ = precision(device)
    torch.manual_seed(0)
    model = peer_model(args.architecture, config, device, dtype)
    if world_size > 1:
        from diffusers import ContextParallelConfig

        model.set_attention_backend("_native_cudnn" if device.type == "cuda" else "native")
        model.enable_parallelism(config=ContextParallelConfig(**{f"{args.cp_method}_degree": world_size}))
    calls = {}
    for size in model_sizes(args, config):
        request = {name: tensor.to(device) for name, tensor in
                   model_family.media_request(config, size.frames, size.height, size.width, dtype).items()}
        calls[str(size)] = (PEERS[args.architecture][1](config, request),
                            model_family.request_size(config, request).tokens)
    rows = time_peer(model, args.modes.split(","), calls, device, args.iterations)
    if rank == 0:
        print(markdown_table(["peer", "size", "median ms", "first call s", "peak GiB"],
                             [[row["peer"], f"{row['size']} ({row['tokens']:,} tokens)", f"{row['median_ms']:,.0f}",
                               f"{row['first_call_s']:.1f}", f"{row['peak_gib']:.1f}"] for row in rows]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, list(PEERS))
    parser.add_argument("--modes", default="eager,compile", help="eager and/or compile (default both)")
    parser.add_argument("--iterations", type=int, default=2, help="timed forwards after the first (default 2)")
    parser.add_argument("--gpus", default="1", help="GPU counts, each run in turn (default 1; e.g. 1,2): more than one "
                                                    "runs diffusers' own context parallelism")
    parser.add_argument("--cp-method", choices=("ulysses", "ring"), default="ulysses",
                        help="diffusers' context parallelism on several GPUs (default ulysses)")
    args = parser.parse_args()
    model_sizes(args, model_config(args))  # refuses a size before any rank starts
    counts = [int(count) for count in args.gpus.split(",")]
    if args.device == "cpu" and max(counts) > 1:
        raise SystemExit("diffusers' context parallelism runs on GPUs only (enable_parallelism picks an accelerator "
                         "per rank); on CPU give --gpus 1")
    for world_size in counts:
        problem = run_ranks(rank_main, world_size, (args,))
        if problem:
            raise SystemExit(problem)


if __name__ == "__main__":
    main()
