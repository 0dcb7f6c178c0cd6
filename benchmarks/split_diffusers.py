"""A diffusers transformer split by its own context-parallel plan on our ranks (mdtriton.pipeline.context_parallel:
our attention methods and Communicator), against the same transformer on one GPU and under diffusers' own context
parallelism (`enable_parallelism` with Ulysses), at a published size with random bf16 weights, batch 1, timed by the
harness's timer (the first call apart: a compile shows there). Modes: eager; compile (the repeated blocks compiled:
`compile_repeated_blocks`); graph (compiled, the whole forward replayed as a CUDA graph, as the engine replays its
forwards: mdtriton.engine.cuda_graphs). Each row's output is compared with one GPU's eager
output (relative error, as `mdtriton bench` reports it).

    python benchmarks/split_diffusers.py --model flux --gpus 1,2 --methods ulysses,ring
    python benchmarks/split_diffusers.py --model qwen-image --sizes 1024,1328 --gpus 1,2
    python benchmarks/split_diffusers.py --model qwen-image --tiny --device cpu --sizes 64,48 --modes eager --no-peer

Models: flux (FluxTransformer2DModel at FLUX.1-dev's config, 512 text tokens), qwen-image
(QwenImageTransformer2DModel at Qwen-Image's config, --text-tokens of text). Run `mdtriton bench --preset flux.1-dev
--gpus 1,2` on the same machine for our hand-written FLUX family at the same size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import sdpa_kernel

from mdtriton.engine.attention.local import KERNEL_PRIORITY
from mdtriton.engine.comm import Communicator
from mdtriton.engine.cuda_graphs import CudaGraphForward
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import family
from mdtriton.harness import (device_name, init_rank, markdown_table, precision, relative_error, run_ranks,
                              time_calls, timing)
from mdtriton.pipeline.context_parallel import split_by_plan

QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
QWEN_IMAGE_TINY = dict(QWEN_IMAGE, num_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                       axes_dims_rope=(4, 6, 6))


def make_model(name: str, tiny: bool) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel

    if name == "flux":
        config = family("flux").presets()["tiny" if tiny else "flux.1-dev"]
        return FluxTransformer2DModel(**{**config, "axes_dims_rope": tuple(config["axes_dims_rope"])})
    return QwenImageTransformer2DModel(**(QWEN_IMAGE_TINY if tiny else QWEN_IMAGE))


def model_call(name: str, tiny: bool, side: int, text_tokens: int, device: torch.device, dtype: torch.dtype) -> dict:
    """The transformer's call for a side x side image, as its pipeline makes it, seeded on the CPU (the same on every
    rank)."""
    if name == "flux":
        config = family("flux").presets()["tiny" if tiny else "flux.1-dev"]
        request = family("flux").media_request(config, 1, side, side, dtype)
    else:
        config = QWEN_IMAGE_TINY if tiny else QWEN_IMAGE
        generator = torch.Generator().manual_seed(0)
        patches = side // 16
        request = {"hidden_states": torch.randn(1, patches * patches, config["in_channels"], generator=generator),
                   "encoder_hidden_states": torch.randn(1, text_tokens, config["joint_attention_dim"],
                                                        generator=generator),
                   "timestep": torch.tensor([0.5]), "img_shapes": [[(1, patches, patches)]]}
    return {key: value.to(device, dtype if value.is_floating_point() else value.dtype)
            if isinstance(value, torch.Tensor) else value for key, value in request.items()} | {"return_dict": False}


def variants(world_size: int, methods: list[str], modes: list[str], peer: bool) -> list[tuple[str, str, str]]:
    """(how it is split, method, mode) of each row on world_size ranks."""
    if world_size == 1:
        return [("one GPU", "-", mode) for mode in modes]
    rows = [("ours", method, mode) for method in methods for mode in modes]
    return rows + ([("diffusers' own", "ulysses", mode) for mode in modes] if peer else [])


def prepared(split: str, method: str, mode: str, args, world_size: int, rank: int, device: torch.device,
             dtype: torch.dtype) -> torch.nn.Module:
    """The model of a row, made in dtype on device (the same random weights on every rank), split and compiled."""
    from diffusers import ContextParallelConfig

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = make_model(args.model, args.tiny).eval()
    finally:
        torch.set_default_dtype(previous)
    if split == "ours":
        comm = Communicator(ParallelPlan(cp_size=world_size, cp_method=method), rank, device)
        comm.join_groups()
        split_by_plan(model, comm)
    elif split == "diffusers' own":  # its "anything" mode only where a size needs it (it costs a size exchange)
        uneven = any((int(side) // 16) ** 2 % world_size for side in args.sizes.split(","))
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size, ulysses_anything=uneven))
    if mode in ("compile", "graph"):
        model.compile_repeated_blocks(fullgraph=split != "ours")  # our attention runs eagerly: a graph break
    return model


def forward_of(model: torch.nn.Module, mode: str, call: dict):
    """A function of no arguments that runs the call and returns the transformer's output: as it is, or (graph) by
    replaying a CUDA graph captured at its first run."""
    if mode != "graph":
        return lambda: model(**call)[0]
    tensors = {name: value for name, value in call.items() if isinstance(value, torch.Tensor)}
    others = {name: value for name, value in call.items() if name not in tensors}
    graphed = CudaGraphForward(lambda **inputs: {"sample": model(**inputs, **others)[0]}, max_graphs=1)
    return lambda: graphed(tensors)["sample"]


def rank_main(rank: int, world_size: int, port: int, args, out_dir: str) -> None:
    device = init_rank(rank, world_size, port, cuda=args.device == "cuda")
    dtype, _ = precision(device)
    cuda = device.type == "cuda"
    rows = []
    for split, method, mode in variants(world_size, args.methods.split(","), args.modes.split(","), args.peer):
        model = None
        for side in [int(n) for n in args.sizes.split(",")]:
            row = {"gpus": world_size, "split": split, "method": method, "mode": mode, "side": side}
            try:  # a peer that fails (to split, or under compile) is a row of its own
                model = model or prepared(split, method, mode, args, world_size, rank, device, dtype)
                forward = forward_of(model, mode, model_call(args.model, args.tiny, side, args.text_tokens, device,
                                                             dtype))
                with torch.inference_mode(), sdpa_kernel(KERNEL_PRIORITY, set_priority=True):
                    first, _ = time_calls(forward, cuda, 0, 1)
                    times, output = time_calls(forward, cuda, 0, args.iterations)
                row |= {"first_call_s": first[0] / 1000, **timing(times)}
                if rank == 0:
                    torch.save(output.float().cpu(), Path(out_dir) / f"{world_size}-{split}-{method}-{mode}-{side}.pt")
            except Exception as error:  # noqa: BLE001
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            if rank == 0:
                rows.append(row)
                print(json.dumps(row), flush=True)
        del model
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        (Path(out_dir) / f"rows-{world_size}.json").write_text(json.dumps(rows))
        (Path(out_dir) / "device.txt").write_text(device_name(device))
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("flux", "qwen-image"), default="flux")
    parser.add_argument("--sizes", default="1024", help="image sides in pixels, comma-separated (default 1024)")
    parser.add_argument("--text-tokens", type=int, default=64, help="qwen-image's text tokens (default 64)")
    parser.add_argument("--gpus", default="1,2", help="rank counts, comma-separated (default 1,2)")
    parser.add_argument("--methods", default="ulysses,ring", help="our methods (default ulysses,ring)")
    parser.add_argument("--modes", default="eager,compile,graph", help="eager, compile, graph (default all)")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="leave out diffusers' own parallelism")
    parser.add_argument("--iterations", type=int, default=3, help="timed forwards after the first (default 3)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs, to check the script on CPU")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for world_size in [int(n) for n in args.gpus.split(",")]:
            problem = run_ranks(rank_main, world_size, (args, out_dir))
            if problem:
                print(problem, flush=True)
            path = Path(out_dir) / f"rows-{world_size}.json"
            rows += json.loads(path.read_text()) if path.exists() else []
        outputs = {path.stem: torch.load(path) for path in Path(out_dir).glob("*.pt")}
        title = (Path(out_dir) / "device.txt").read_text() if (Path(out_dir) / "device.txt").exists() else ""
    one_gpu = {row["side"]: row["median_ms"] for row in rows if row["gpus"] == 1 and row["mode"] == "eager"
               and "median_ms" in row}
    table = []
    for row in rows:
        if "error" in row:
            table.append([row["gpus"], row["split"], row["method"], row["mode"], row["side"], "-", "-", "-", "-",
                          row["error"]])
            continue
        output = outputs[f"{row['gpus']}-{row['split']}-{row['method']}-{row['mode']}-{row['side']}"]
        reference = outputs.get(f"1-one GPU---eager-{row['side']}")
        error = f"{relative_error(output, reference):.1e}" if reference is not None else "-"
        speedup = f"{one_gpu[row['side']] / row['median_ms']:.2f}x" if row["side"] in one_gpu else "-"
        table.append([row["gpus"], row["split"], row["method"], row["mode"], row["side"], f"{row['median_ms']:,.1f}",
                      speedup, f"{row['first_call_s']:.1f}", error, ""])
    print(f"\n{args.model}, batch 1, {title}")
    print(markdown_table(["GPUs", "split", "method", "mode", "side", "median ms", "vs 1 GPU eager", "first call s",
                          "error vs 1 GPU eager", "failed"], table))


if __name__ == "__main__":
    main()
