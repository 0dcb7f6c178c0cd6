"""One Cosmos 3 transformer forward: ours on one GPU (bf16 as the pipeline runs a step, with the text's keys and
values made once per request; bf16 with the text run at every call, as a transformer engine and diffusers run it;
FP8) against diffusers' Cosmos3OmniTransformer (eager, and regionally compiled) in one process, at 480p and 720p x 189
frames (the pipeline's default); then, with --gpus, each parallel method on 2 and 4 GPUs against our 1 GPU.

Ours is loaded the way the server loads it (the benchmark harness, mdtriton/harness.py: TorchEngine.from_weights,
then its compile and warm-up), with random weights made on the GPU from one seed (the same full model for every
plan); diffusers' model gets its own random weights (the same sizes; random weights time the same as trained ones).
Inputs as Cosmos3OmniPipeline makes them: 256 text tokens, the latent video [1, 48, 48, H/16, W/16], timestep 500,
every frame noisy, positions at 24 fps. Times: the harness's timer (CUDA events) around whole forwards, the median of
--iterations after the first call at each size (reported apart: a recompile would show there); peak memory allocated
during each size. The multi-GPU rows give each method's speed-up over our 1 GPU and its output's relative error to
our 1 GPU's (bf16 rounding: the methods should agree to it).

    python benchmarks/cosmos3_forward.py                          # cosmos3-15b, 480p and 720p, one GPU, diffusers too
    python benchmarks/cosmos3_forward.py --gpus 1,2,4 --peers none --variants bf16 --sizes 720p
    python benchmarks/cosmos3_forward.py --tiny --gpus 1,2        # checks the script on the CPU (gloo ranks)
    python benchmarks/cosmos3_forward.py --device cpu --frames 9 --sizes 480p --peers none --variants bf16 \
        --config '{"hidden_size": 1024, "head_dim": 64, "num_attention_heads": 16, "num_key_value_heads": 4,
                   "intermediate_size": 3072, "num_hidden_layers": 4}'   # the text pathway's cost on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mdtriton.build_tools.engine_builder import random_shard  # noqa: E402
from mdtriton.engine.comm import Communicator  # noqa: E402
from mdtriton.engine.plan import ParallelPlan  # noqa: E402
from mdtriton.families.cosmos3 import COSMOS3  # noqa: E402
from mdtriton.harness import (bench_engine, forward_table, init_rank, markdown_table, plans_for,  # noqa: E402
                              relative_error, run_ranks, time_calls, timed_forward)

# (rows, columns) of 2x2 patches of a frame: the VAE makes 45 x 80 latent pixels of a 720p frame (padded to 46), 30 x
# 52 of a 480p one.
SIZES = {"480p": (15, 26), "720p": (23, 40)}
FRAMES = 189
METHODS = ("allgather_kv", "ring", "ulysses", "tp", "tp_cp")


def request(config: dict, args, label: str, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    grid = (((args.frames - 1) // 4 + 1), *SIZES[label])
    return {name: t.to(device) for name, t in COSMOS3.inputs(config, args.text_tokens, grid, dtype).items()}


def ours(args, config: dict, device: torch.device, quantization: str | None) -> dict[str, dict]:
    """Our engine as the server loads it: {row: {size: (first, times, peak)}}: the pipeline's step (the text's keys
    and values handed in), and in bf16 also the text at every call and the text pathway alone."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    data_type = "FP32" if device.type == "cpu" else "BF16"
    start = time.perf_counter()
    weights = random_shard("cosmos3", config, ParallelPlan(), 0, seed=0, device=device, dtype=dtype,
                           quantization=quantization)
    made = time.perf_counter() - start
    engine = bench_engine("cosmos3", config, Communicator.single(device), weights, data_type, quantization)
    variant = quantization or data_type.lower()
    print(f"ours ({variant}): weights made in {made:.0f} s, loaded in {engine.load_seconds:.1f} s, compiled and "
          f"warmed up in {engine.warm_up_seconds:.0f} s", flush=True)
    rows = {f"mdtriton {variant}, text once": {}}
    if quantization is None:
        rows.update({f"mdtriton {variant}, text every call": {}, "text pathway alone (once per request)": {}})
    for label in args.sizes:
        inputs = request(config, args, label, device, dtype)
        with torch.inference_mode():
            text = engine.module.text_keys_values(inputs["input_ids"], inputs["position_ids"])
        step = {**{k: v for k, v in inputs.items() if k != "input_ids"}, "text_keys_values": text}
        calls = [lambda: engine.forward(step), lambda: engine.forward(inputs),
                 lambda: engine.module.text_keys_values(inputs["input_ids"], inputs["position_ids"])]
        for row, call in zip(rows, calls):
            with torch.inference_mode():
                rows[row][label] = timed_forward(call, device, args.iterations)
            print(f"  {row}, {label}: {statistics.median(rows[row][label][1]) * 1000:,.1f} ms", flush=True)
    return rows


def diffusers_call(config: dict, inputs: dict[str, torch.Tensor]) -> dict:
    """diffusers' call of its transformer for our request, as Cosmos3OmniPipeline packs it (text, then the video)."""
    latent = inputs["vision_tokens"]
    p = config["latent_patch_size"]
    grid = (latent.shape[2], -(-latent.shape[3] // p), -(-latent.shape[4] // p))
    text, video = inputs["input_ids"].shape[0], grid[0] * grid[1] * grid[2]
    device = latent.device
    return {"input_ids": inputs["input_ids"], "text_indexes": torch.arange(text, device=device),
            "position_ids": inputs["position_ids"], "und_len": text, "sequence_length": text + video,
            "vision_tokens": [latent], "vision_token_shapes": [grid],
            "vision_sequence_indexes": torch.arange(text, text + video, device=device),
            "vision_mse_loss_indexes": torch.arange(text, text + video, device=device),
            "vision_timesteps": inputs["timestep"].expand(video),
            "vision_noisy_frame_indexes": [torch.arange(grid[0], device=device)], "return_dict": False}


def diffusers_peer(args, config: dict, device: torch.device) -> dict[str, dict]:
    """diffusers' model, eager (torch's SDPA choice) and regionally compiled (its repeated decoder layers, cuDNN
    attention, as benchmarks/wan_forward.py does Wan's): {row: {size: (first, times, peak)}}."""
    from diffusers import Cosmos3OmniTransformer

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype on the device: 15 B float32 parameters would not fit
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = Cosmos3OmniTransformer(**config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.time_embedder.float()  # diffusers keeps it in float32 (_keep_in_fp32_modules)
    print(f"diffusers: model made in {time.perf_counter() - start:.0f} s", flush=True)
    rows = {}
    for mode in args.peers:
        if mode == "compile":
            model.compile_repeated_blocks(fullgraph=True)
        rows[f"diffusers {mode}"] = {}
        for label in args.sizes:
            call = diffusers_call(config, request(config, args, label, device, dtype))
            backends = [SDPBackend.CUDNN_ATTENTION] if mode == "compile" and device.type == "cuda" else None
            with torch.inference_mode(), (sdpa_kernel(backends) if backends else nullcontext()):
                rows[f"diffusers {mode}"][label] = timed_forward(lambda: model(**call), device, args.iterations)
            print(f"  diffusers {mode}, {label}: "
                  f"{statistics.median(rows[f'diffusers {mode}'][label][1]) * 1000:,.1f} ms", flush=True)
    return rows


def rank_main(rank: int, world_size: int, port: int, args, config: dict, methods: list[str], out: str) -> None:
    """One rank of a GPU count: each method's step (text handed in, as the pipeline runs it) at each size; rank 0
    writes {method: {size: [median seconds, output]}} to out."""
    device = init_rank(rank, world_size, port, args.device == "cuda")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    results = {}
    for name, plan in plans_for(world_size, methods).items():
        try:
            COSMOS3.check_plan(config, plan)
        except ValueError as error:
            print(f"{world_size} GPUs, {name}: skipped ({error})", flush=True)
            continue
        comm = Communicator(plan, rank, device)
        comm.join_groups()
        weights = random_shard("cosmos3", config, plan, rank, seed=0, device=device, dtype=dtype)
        engine = bench_engine("cosmos3", config, comm, weights, "FP32" if args.device == "cpu" else "BF16")
        results[name] = {}
        for label in args.sizes:
            inputs = request(config, args, label, device, dtype)
            with torch.inference_mode():
                text = engine.module.text_keys_values(inputs["input_ids"], inputs["position_ids"])
            step = {**{k: v for k, v in inputs.items() if k != "input_ids"}, "text_keys_values": text}
            times, outputs = time_calls(lambda: engine.forward(step), args.device == "cuda", 1, args.iterations)
            results[name][label] = [statistics.median(times) / 1000, outputs["sample"].float().cpu().tolist()]
        del engine
        free_memory(device)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def multi_gpu(args, config: dict) -> dict[str, dict]:
    """{row: {size: (seconds, relative error to 1 GPU)}} for every GPU count and method, each count in its own
    processes."""
    found = {}
    with tempfile.TemporaryDirectory() as scratch:
        for count in args.gpus:
            out = f"{scratch}/{count}.json"
            failure = run_ranks(rank_main, count, (args, config, METHODS, out))
            if failure:
                print(failure, flush=True)
                continue
            found[count] = json.loads(Path(out).read_text())
    baseline = found.get(1, {}).get("1 GPU", {})
    rows = {}
    for count, methods in found.items():
        for name, sizes in methods.items():
            rows[name if count == 1 else f"{count} GPUs, {name}"] = {
                label: (seconds, relative_error(torch.tensor(sample), torch.tensor(baseline[label][1]))
                        if label in baseline else float("nan"))
                for label, (seconds, sample) in sizes.items()}
    return rows


def free_memory(device: torch.device) -> None:
    """Give back what the last model held before the next one is made (two models of 15 B do not fit one GPU)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny Cosmos 3 on the CPU, 9 frames (checks the script)")
    parser.add_argument("--preset", default="cosmos3-15b", choices=sorted(COSMOS3.presets()))
    parser.add_argument("--config", default="{}", help="JSON overriding the preset's config")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="GPUs (bf16), or the CPU (float32, gloo ranks) (default cuda)")
    parser.add_argument("--sizes", default="480p,720p", help="comma-separated: 480p, 720p (default both)")
    parser.add_argument("--frames", type=int, default=FRAMES, help=f"frames, 4k+1 (default {FRAMES})")
    parser.add_argument("--text-tokens", type=int, default=256, help="text tokens (default 256)")
    parser.add_argument("--variants", default="bf16,fp8", help="ours on 1 GPU: bf16, fp8, or none (default both)")
    parser.add_argument("--peers", default="eager,compile", help="diffusers: eager, compile, or none")
    parser.add_argument("--gpus", default="1", help="GPU counts for the methods' rows, e.g. 1,2,4 (default 1: none)")
    parser.add_argument("--iterations", type=int, default=2, help="timed forwards after the first (default 2)")
    args = parser.parse_args()
    args.sizes = args.sizes.split(",")
    args.peers = [] if args.peers == "none" else args.peers.split(",")
    args.gpus = [int(count) for count in args.gpus.split(",")]
    if args.tiny:
        SIZES.update({"480p": (3, 4), "720p": (4, 7)})
        args.frames, args.text_tokens, args.device, args.preset = 9, 21, "cpu", "tiny"
    device = torch.device("cpu" if args.device == "cpu" else "cuda:0")
    config = {**COSMOS3.presets()[args.preset], **json.loads(args.config)}

    rows = {}
    for variant in ([] if args.variants == "none" else args.variants.split(",")):
        rows.update(ours(args, config, device, "fp8" if variant == "fp8" else None))
        free_memory(device)
    if args.peers:
        rows.update(diffusers_peer(args, config, device))
        free_memory(device)

    where = "CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"\n{args.preset} {args.config}, {args.frames} frames, {args.text_tokens} text tokens, "
          f"{where}, torch {torch.__version__}; median of {args.iterations} forwards after the first\n")
    tokens = {label: COSMOS3.check_request(config, request(config, args, label, torch.device("cpu"),
                                                           torch.float32)).tokens for label in args.sizes}
    if rows:
        print(forward_table(rows, tokens, "diffusers compile"))
    if args.gpus != [1]:
        methods = multi_gpu(args, config)
        one = {label: methods.get("1 GPU", {}).get(label, (float("nan"),))[0] for label in args.sizes}
        print("\nEach method's step (the text handed in), its speed-up over our 1 GPU, and its output's relative error "
              "to our 1 GPU's\n")
        print(markdown_table(["plan", *(f"{label} ({tokens[label]:,} tokens)" for label in args.sizes)],
                             [[name, *(f"{results[label][0] * 1000:,.1f} ms ({one[label] / results[label][0]:.2f}x, "
                                       f"error {results[label][1]:.1e})" for label in args.sizes)]
                              for name, results in methods.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
