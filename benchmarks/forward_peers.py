"""The peers of `mdtriton bench`: the same transformer forward in diffusers and in xDiT, measured as `mdtriton bench`
measures our engine and shown in its tables beside our rows (mdtriton/bench.py: its arguments, rank processes, timing,
errors against one GPU and float32, and tables).

For each GPU count, after our engine's rows (--no-ours: without them), each of --peers runs in rank processes of its
own (one per GPU), with our random weights (mdtriton.harness.bench_weights, loaded by parameter name; Cosmos 3's
language-model head and last norm, which a video does not use, keep diffusers' initialization) at the bench's requests
(Family.media_request; Cosmos 3's packed as Cosmos3OmniPipeline packs them):

- diffusers: diffusers' own transformer of the family (FluxTransformer2DModel, WanTransformer3DModel,
  Cosmos3OmniTransformer with its time embedder in float32, as diffusers keeps it) on one GPU, and on N with diffusers'
  own context parallelism (`enable_parallelism`, --cp-method ulysses or ring, cuDNN attention; GPUs only);
- split (FLUX, Wan: Cosmos 3's class declares no plan): the same transformer split by its class's `_cp_plan` on our
  N ranks, by each of --methods that is a context-parallel method (mdtriton.pipeline.context_parallel: how
  `diffusers-pipeline` serves a transformer that has no family of ours);
- xdit (FLUX, GPUs): xDiT's `xFuserFlux1Transformer2DWrapper` (xfuser 0.7.0: diffusers' FLUX transformer with xDiT's
  sequence split, USP attention with its own attention backend, and gather), set up as xfuser's FLUX.1-dev runner sets
  it up without the pipeline, alone on one GPU and in each of --xdit-configs on N (ulyssesN, ringN, ulyssesNxringM;
  default ulyssesN).

Modes (--modes, in this order on one model): eager (torch's SDPA choice); compile (diffusers' repeated blocks
compiled; xDiT's whole forward compiled with torch.compile's defaults, as xfuser's --use_torch_compile compiles it;
SDPA's kernels ranked as our engine ranks them, cuDNN's first); graph (GPUs: compiled, the whole forward replayed as
one CUDA graph, as our engine replays its forwards). A peer that fails at a GPU count is said, its rows so far kept,
and the others go on; the script then exits non-zero.

    python benchmarks/forward_peers.py --architecture flux --gpus 1,2 --methods ulysses --height 1024 --width 1024
    python benchmarks/forward_peers.py --gpus 1,4 --methods ulysses --variants compiled --height 1024 --width 1024 \\
        --peers xdit --modes compile --xdit-configs ulysses4
    python benchmarks/forward_peers.py --architecture wan --gpus 1 --variants compiled,fp8 --height 480,720 \\
        --width 832,1280 --frames 81 --iterations 2
    python benchmarks/forward_peers.py --device cpu --preset tiny --height 64 --width 64 --gpus 1,2 \\
        --methods ulysses,ring --variants eager --peers diffusers,split --modes eager   # checks the script on CPU

xDiT needs xfuser 0.7.0, yunchang 0.6.4 and distvae 0.1.0 (`pip install ".[peers]"`: pure-Python wheels).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

from mdtriton.bench import (add_arguments, add_errors, forward_row, free_memory, measure, prepare, report,
                            sample_file, save_sample)
from mdtriton.engine.attention.local import KERNEL_PRIORITY
from mdtriton.engine.comm import Communicator
from mdtriton.engine.cuda_graphs import CudaGraphForward
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import family
from mdtriton.harness import bench_weights, init_rank, model_config, plans_for, precision, run_ranks
from mdtriton.pipeline.context_parallel import split_by_plan
from pipeline_peers import degrees_of, start_xdit_rank

PEERS = ("diffusers", "split", "xdit")
MODES = ("eager", "compile", "graph")


def diffusers_model(architecture: str, config: dict, device: torch.device, dtype: torch.dtype,
                    weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """diffusers' transformer of the architecture at config, made on device in dtype, our weights copied in by name."""
    import diffusers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            if architecture == "flux":
                axes = tuple(config["axes_dims_rope"])
                model = diffusers.FluxTransformer2DModel(**{**config, "axes_dims_rope": axes})
            elif architecture == "wan":
                model = diffusers.WanTransformer3DModel(**{**config, "patch_size": tuple(config["patch_size"])})
            else:
                model = diffusers.Cosmos3OmniTransformer(**config)
                model.time_embedder.float()  # diffusers' _keep_in_fp32_modules
    finally:
        torch.set_default_dtype(previous)
    unexpected = model.load_state_dict(weights, strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"{type(model).__name__} has no parameters named {', '.join(unexpected[:3])}")
    return model.eval()


def xdit_flux(config: dict, weights: dict[str, torch.Tensor], ulysses: int, ring: int,
              text_tokens: int) -> torch.nn.Module:
    """xDiT's FLUX transformer for ulysses x ring, set up as xfuser's FLUX.1-dev runner sets it up without the
    pipeline: its groups made anew (yunchang's, which its attention reads, may be another configuration's), its
    runtime state (the attention backend of its choice), our weights (shared, not copied)."""
    from xfuser.config import xFuserArgs
    from xfuser.core.distributed import get_runtime_state, initialize_runtime_state, parallel_state
    from xfuser.model_executor.models.transformers.transformer_flux import xFuserFlux1Transformer2DWrapper

    if ulysses * ring > 1 and not parallel_state.HAS_LONG_CTX_ATTN:
        raise RuntimeError("xfuser found no usable yunchang, so its sequence-parallel groups would have one rank each")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(sequence_parallel_degree=ulysses * ring, ulysses_degree=ulysses,
                                             ring_degree=ring, backend="nccl")
    engine_config, _ = xFuserArgs(ulysses_degree=ulysses, ring_degree=ring).create_config()
    # The runtime state reads the heads from pipeline.transformer.config (to check ulysses_degree against them).
    pipeline = types.SimpleNamespace(transformer=types.SimpleNamespace(config=types.SimpleNamespace(**config)))
    initialize_runtime_state(pipeline, engine_config)
    state = get_runtime_state()
    # What the FLUX runner's set_input_parameters sets, without the pipeline's patch bookkeeping.
    state.max_condition_sequence_length, state.split_text_embed_in_sp, state.text_embed_sp_pad = text_tokens, True, 0
    with torch.device("meta"):
        model = xFuserFlux1Transformer2DWrapper(**config)
    model.load_state_dict(weights, assign=True)
    return model.eval()


def peer_models(peer: str, args: argparse.Namespace, rank: int, world_size: int, device: torch.device,
                weights: dict[str, torch.Tensor], requests: dict[str, dict]):
    """The peer's models on world_size ranks, one after another: (method, plan described, model)."""
    config = model_config(args)
    dtype, _ = precision(device)
    if peer == "xdit":
        from xfuser.core.distributed import parallel_state

        parallel_state.init_distributed_environment(rank=rank, world_size=world_size, local_rank=rank,
                                                    backend="nccl")
        text_tokens = next(iter(requests.values()))["encoder_hidden_states"].shape[1]
        for name in xdit_configs(args, world_size):
            ulysses, ring = degrees_of(name)
            model = xdit_flux(config, weights, ulysses, ring, text_tokens)
            yield f"xDiT {name}", f"xfuser, ulysses {ulysses} x ring {ring}", model
    elif peer == "diffusers":
        model = diffusers_model(args.architecture, config, device, dtype, weights)
        if world_size > 1:
            from diffusers import ContextParallelConfig

            model.set_attention_backend("_native_cudnn")
            model.enable_parallelism(config=ContextParallelConfig(**{f"{args.cp_method}_degree": world_size}))
        yield "diffusers", f"{args.cp_method} {world_size}, enable_parallelism" if world_size > 1 else "1 GPU", model
    else:
        for method, plan in split_plans(args, world_size).items():
            model = diffusers_model(args.architecture, config, device, dtype, weights)
            comm = Communicator(plan, rank, device)
            comm.join_groups()
            split_by_plan(model, comm)
            yield f"diffusers split: {method}", f"{plan}, our ranks", model


def xdit_configs(args: argparse.Namespace, world_size: int) -> list[str]:
    """xDiT's configurations on world_size GPUs: 1 alone, else those of --xdit-configs on as many (ulyssesN)."""
    if world_size == 1:
        return ["1"]
    names = args.xdit_configs.split(",") if args.xdit_configs else [f"ulysses{world_size}"]
    return [name for name in names if degrees_of(name)[0] * degrees_of(name)[1] == world_size]


def split_plans(args: argparse.Namespace, world_size: int) -> dict[str, ParallelPlan]:
    """The context-parallel plans of --methods on world_size ranks (none on one)."""
    if world_size == 1:
        return {}
    return {method: plan for method, plan in plans_for(world_size, args.methods).items() if plan.tp_size == 1}


def call_arguments(architecture: str, config: dict, request: dict[str, torch.Tensor]) -> dict:
    """diffusers' call of its transformer for our request: FLUX's and Wan's by the same names; Cosmos 3's packed as
    Cosmos3OmniPipeline packs it (the text, then the video's tokens, every frame noisy)."""
    if architecture != "cosmos3":
        return {**request, "return_dict": False}
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


def forward_of(model: torch.nn.Module, mode: str, arguments: dict):
    """A function of no arguments that runs the model on the arguments and returns its sample (Cosmos 3's: its one
    video's): as it is, or (graph) by replaying a CUDA graph captured at its first run."""
    def sample(**tensors) -> torch.Tensor:
        output = model(**tensors, **others)[0]
        return output[0] if isinstance(output, list) else output

    tensors = {name: value for name, value in arguments.items() if isinstance(value, torch.Tensor)}
    others = {name: value for name, value in arguments.items() if name not in tensors}
    if mode != "graph":
        return lambda: sample(**tensors)
    graphed = CudaGraphForward(lambda **inputs: {"sample": sample(**inputs)}, max_graphs=1)
    return lambda: graphed(tensors)["sample"]


def compile_model(peer: str, model: torch.nn.Module) -> None:
    """Compile the model as the peer compiles it (the module docstring), in place."""
    if peer == "xdit":
        model.forward = torch.compile(model.forward)
    else:  # our attention methods run eagerly between the compiled blocks: a graph break
        model.compile_repeated_blocks(fullgraph=peer == "diffusers")


def _peer_rank(rank: int, world_size: int, port: int, args: argparse.Namespace, work_dir: str, peer: str) -> None:
    cuda = args.device == "cuda"
    device = start_xdit_rank(rank, world_size, port) if peer == "xdit" else init_rank(rank, world_size, port, cuda)
    config = model_config(args)
    model_family = family(args.architecture)
    dtype, _ = precision(device)
    requests = {str(size): {name: tensor.to(device) for name, tensor in
                            model_family.media_request(config, size.frames, size.height, size.width, dtype).items()}
                for size in args.sizes}
    tokens = {label: model_family.request_size(config, request).tokens for label, request in requests.items()}
    weights = bench_weights(args.architecture, config, ParallelPlan(), 0, device, dtype, None)
    rows, rows_file = [], Path(work_dir) / f"{peer}-{world_size}.json"
    for method, described, model in peer_models(peer, args, rank, world_size, device, weights, requests):
        for mode in args.modes:
            if mode == "compile" or (mode == "graph" and "compile" not in args.modes):
                compile_model(peer, model)
            for label, request in requests.items():
                ranked = sdpa_kernel(KERNEL_PRIORITY, set_priority=True) if cuda and mode != "eager" else nullcontext()
                with torch.no_grad(), ranked:
                    forward = forward_of(model, mode, call_arguments(args.architecture, config, request))
                    row, output = forward_row(forward, args, device)
                rows.append({"gpus": world_size, "method": method, "variant": mode, "plan": described, "size": label,
                             "tokens": tokens[label], "warm_up_s": 0.0, **row})
                if rank == 0:
                    print(json.dumps(rows[-1]), flush=True)
                    rows_file.write_text(json.dumps(rows))  # kept if a later model fails
                    if label == str(args.sizes[0]) and args.check:
                        save_sample(output, Path(work_dir) / sample_file(world_size, method, mode))
        model = forward = output = None
        free_memory(device)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, ["flux", "wan", "cosmos3"])
    parser.add_argument("--peers", default="diffusers,split", help=f"of {', '.join(PEERS)} (default diffusers,split)")
    parser.add_argument("--modes", default="eager,compile", help=f"the peers' modes, of {', '.join(MODES)} (default "
                                                                 "eager,compile)")
    parser.add_argument("--cp-method", choices=("ulysses", "ring"), default="ulysses",
                        help="diffusers' own context parallelism on several GPUs (default ulysses)")
    parser.add_argument("--xdit-configs", help="xDiT's configurations on several GPUs: ulyssesN, ringN, "
                                               "ulyssesNxringM (default ulyssesN for each GPU count)")
    parser.add_argument("--no-ours", dest="ours", action="store_false",
                        help="the peers alone (no speed-ups or errors against our 1-GPU forward)")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="seconds a peer may take at a GPU count before its ranks are stopped (default 0: none)")
    args = parser.parse_args(argv)
    args.peers = args.peers.split(",")
    given = args.modes.split(",")
    args.modes = [mode for mode in MODES if mode in given]
    unknown = (set(args.peers) - set(PEERS)) | (set(given) - set(MODES))
    if unknown:
        parser.error(f"unknown peers or modes: {', '.join(sorted(unknown))}")
    if args.device == "cpu" and ("graph" in args.modes or "xdit" in args.peers):
        parser.error("CUDA graphs and xDiT run on GPUs: leave out --modes graph and the xdit peer with --device cpu")
    if "xdit" in args.peers and args.architecture != "flux":
        parser.error("the xdit peer runs FLUX's transformer: give --architecture flux")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prepare(args)
    failures = []
    with tempfile.TemporaryDirectory() as work_dir:
        rows, attention_rows = measure(args, work_dir) if args.ours else ([], [])
        for world_size in args.counts:
            for peer in args.peers:
                if world_size > 1 and peer == "diffusers" and args.device == "cpu":
                    print("diffusers' own context parallelism runs on GPUs only: left out on CPU ranks", flush=True)
                    continue
                if (peer == "split" and world_size == 1) or (peer == "xdit" and not xdit_configs(args, world_size)):
                    continue
                problem = run_ranks(_peer_rank, world_size, (args, work_dir, peer), args.time_limit)
                failures += [f"{peer} on {world_size} GPU(s): {problem}"] if problem else []
                path = Path(work_dir) / f"{peer}-{world_size}.json"
                rows += json.loads(path.read_text()) if path.exists() else []
        add_errors(rows, str(args.sizes[0]), work_dir, args.baseline)
    report(args, rows, attention_rows, {"failures": failures})
    for failure in failures:
        print(f"could not run: {failure}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
