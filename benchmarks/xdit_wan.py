"""xDiT's Wan 2.1 transformer forward against ours, in the same processes on the same GPUs: the peer of the issue's
"never slower than diffusers' context parallelism or xDiT" for Wan (`mdtriton bench --architecture wan` times ours
alone, `diffusers_peer.py` diffusers' on one GPU).

For each GPU count (one process per GPU, NCCL; gloo ranks on the CPU, where xfuser is first patched by
benchmarks/xdit_cpu_check.py's `patch`), at each size (the bench's model arguments: --preset, --config, --height,
--width, --frames; the request our Wan pipeline sends its transformer, Family.media_request, whose names are diffusers'):
- ours: the engine of each --ours method, loaded as the server loads it (`bench_engine`: compiled on GPUs, blocks
  warmed up at load) and timed through its forward;
- xDiT: xfuser 0.7.0's `xFuserWanTransformer3DWrapper` (diffusers' WanTransformer3DModel with xDiT's USP attention in
  its self-attention, the sequence split and gathered around the blocks), in each --configs configuration, made as its
  Wan 2.1 T2V runner makes it (the attention options of its xFuserArgs) and compiled as its --use_torch_compile
  compiles it (torch.compile's default mode, the whole transformer; --mode eager: uncompiled);
both with the same random weights (our seeded generator, the names diffusers' model takes) and inputs. Timing by the
harness's timer (CUDA events, ranks lined up by a barrier): the first call apart (xDiT's compile shows there), then
--warmup and --iterations calls, the median reported. At the first size every output is compared with our 1-GPU output
(relative error of the norm). Rows are printed as JSON as they are measured (rank 0), then a table.

    PYTHONPATH=$PWD:SITE python benchmarks/xdit_wan.py --gpus 1,4 --configs ulysses4 --ours ulysses,allgather_kv
    PYTHONPATH=$PWD:SITE python benchmarks/xdit_wan.py --device cpu --preset tiny --height 32 --width 48 --frames 9 \\
        --gpus 1,2 --mode eager                                  # checks the script on CPU ranks

SITE: where xfuser 0.7.0, yunchang 0.6.4, distvae 0.1.0 and einops are installed (benchmarks/served_pipeline.py says how
to carry them); on the CPU also triton.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/xdit_wan.py` from anywhere
    sys.path.insert(0, str(REPO))

from mdtriton.build_tools.engine_builder import random_shard  # noqa: E402
from mdtriton.engine.comm import Communicator  # noqa: E402
from mdtriton.engine.plan import ParallelPlan  # noqa: E402
from mdtriton.families.wan import WAN  # noqa: E402
from mdtriton.harness import (add_model_arguments, bench_engine, device_name, markdown_table, model_config,  # noqa: E402
                              model_sizes, plans_for, precision, relative_error, run_ranks, time_calls, timing)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from xdit_flux import config_name, sp_configs  # noqa: E402
from xdit_pipeline import start_xdit_rank  # noqa: E402


def timed_row(args, rank: int, call, **row) -> tuple[dict, torch.Tensor]:
    """The call's first time apart, then the median of --iterations after --warmup; the row printed by rank 0."""
    first, _ = time_calls(call, args.device == "cuda", 0, 1)
    times, out = time_calls(call, args.device == "cuda", args.warmup, args.iterations)
    row = {**row, **timing(times), "first_ms": first[0]}
    if rank == 0:
        print(json.dumps(row), flush=True)
    return row, out


def xdit_wan(config: dict, weights: dict, ulysses: int, ring: int, cuda: bool, compiled: bool,
             device: torch.device) -> torch.nn.Module:
    """xfuser's groups and runtime state for ulysses x ring (made anew: another configuration's may be up), and its
    Wan transformer with our weights, as its Wan 2.1 T2V runner makes it."""
    from accelerate import init_empty_weights
    from xfuser import xFuserArgs
    from xfuser.core.distributed import initialize_runtime_state, parallel_state
    from xfuser.model_executor.models.runner_models.wan import _build_attention_kwargs
    from xfuser.model_executor.models.transformers.transformer_wan import xFuserWanTransformer3DWrapper

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(sequence_parallel_degree=ulysses * ring, ulysses_degree=ulysses,
                                             ring_degree=ring, backend="nccl" if cuda else "gloo")
    # On GPUs xfuser picks its own attention backend; on the CPU the one xdit_cpu_check.patch gives a log-sum-exp.
    xfuser_args = xFuserArgs(ulysses_degree=ulysses, ring_degree=ring,
                             attention_backend=None if cuda else "SDPA_EFFICIENT")
    engine_config, _ = xfuser_args.create_config()
    # The runtime state reads the heads from pipeline.transformer.config (to check ulysses_degree against them).
    pipeline = types.SimpleNamespace(transformer=types.SimpleNamespace(config=types.SimpleNamespace(**config)))
    initialize_runtime_state(pipeline, engine_config)
    # Parameters on the meta device, to take ours; buffers made as the modules make them (the rotary tables).
    with init_empty_weights(include_buffers=False):
        model = xFuserWanTransformer3DWrapper(**{**config, "patch_size": tuple(config["patch_size"])},
                                              attention_kwargs=_build_attention_kwargs(xfuser_args))
    model.load_state_dict(weights, assign=True)
    model = model.to(device).eval()
    return torch.compile(model) if compiled else model


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, work_dir: str) -> None:
    cuda = args.device == "cuda"
    device = start_xdit_rank(rank, world_size, port, cuda)
    config = model_config(args)
    dtype, data_type = precision(device)
    requests = {str(size): {name: tensor.to(device) for name, tensor in
                            WAN.media_request(config, size.frames, size.height, size.width, dtype).items()}
                for size in model_sizes(args, config)}
    first_size = next(iter(requests))
    weights = random_shard("wan", config, ParallelPlan(), 0, seed=0, device=device, dtype=dtype)
    compiled = args.mode == "compiled"

    def record(row: dict, out: torch.Tensor) -> None:
        if rank == 0 and row["size"] == first_size:
            torch.save(out.float().cpu(), Path(work_dir) / f"{world_size}-{row['implementation']}-{row['config']}.pt")
        rows.append(row)

    def measure_ours(method: str, plan: ParallelPlan) -> None:  # its engine freed on return, before the next's
        comm = Communicator(plan, rank, device)
        comm.join_groups()
        shard = dict(weights) if plan.tp_size == 1 else random_shard("wan", config, plan, rank, seed=0, device=device,
                                                                     dtype=dtype)
        engine = bench_engine("wan", config, comm, shard, data_type, compiled=compiled)
        for label, request in requests.items():
            record(*timed_row(args, rank, lambda: engine.forward(request)["sample"], gpus=world_size, size=label,
                              implementation="ours", config=method, plan=str(plan)))

    rows = []
    for method, plan in plans_for(world_size, args.ours.split(",")).items():
        measure_ours(method, plan)
    from xfuser.core.distributed import parallel_state

    parallel_state.init_distributed_environment(rank=rank, world_size=world_size, local_rank=rank,
                                                backend="nccl" if cuda else "gloo")
    for ulysses, ring in sp_configs(world_size, config["num_attention_heads"], args.configs):
        model = xdit_wan(config, weights, ulysses, ring, cuda, compiled, device)
        for label, request in requests.items():
            with torch.no_grad():  # as xDiT's pipelines call it
                record(*timed_row(args, rank, lambda: model(**request, return_dict=False)[0], gpus=world_size,
                                  size=label, implementation="xDiT", config=config_name(ulysses, ring),
                                  plan=f"ulysses {ulysses} x ring {ring}"))
    if rank == 0:
        (Path(work_dir) / f"rows-{world_size}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, ["wan"])
    parser.add_argument("--gpus", default="1,4", help="GPU counts (default 1,4; the first must be 1: the baseline)")
    parser.add_argument("--ours", default="ulysses,allgather_kv", help="our methods (default ulysses,allgather_kv)")
    parser.add_argument("--configs", default="all",
                        help="xDiT's configurations on more than one GPU: ulyssesN, ringN, 'usp uNrM' (default all "
                             "those the heads allow)")
    parser.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=0, help="seconds a GPU count may take (default: no limit)")
    args = parser.parse_args()
    args.architecture = "wan"
    gpu_counts = [int(count) for count in args.gpus.split(",")]
    if gpu_counts[0] != 1:
        raise SystemExit("--gpus must start with 1: every row is compared with our 1-GPU forward")
    rows = []
    with tempfile.TemporaryDirectory(prefix="xdit-wan-") as work_dir:
        for world_size in gpu_counts:
            failure = run_ranks(_rank_main, world_size, (args, work_dir), args.time_limit)
            if failure:
                print(f"{world_size} GPU(s): {failure}", flush=True)
            rows_file = Path(work_dir) / f"rows-{world_size}.json"
            rows += json.loads(rows_file.read_text()) if rows_file.is_file() else []
        reference = Path(work_dir) / "1-ours-1 GPU.pt"
        for row in rows:
            sample = Path(work_dir) / f"{row['gpus']}-{row['implementation']}-{row['config']}.pt"
            if reference.is_file() and sample.is_file():
                row["error"] = relative_error(torch.load(sample), torch.load(reference))
    baseline = {row["size"]: row["median_ms"] for row in rows if row["gpus"] == 1 and row["implementation"] == "ours"}
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    print(f"\nWan transformer ({args.preset}), {args.mode}, {device_name(device)}; median of {args.iterations} calls\n")
    print(markdown_table(
        ["size", "GPUs", "implementation", "configuration", "median ms", "first call ms", "speed-up vs our 1 GPU",
         "error vs our 1 GPU"],
        [[row["size"], str(row["gpus"]), row["implementation"], f"{row['config']} ({row['plan']})",
          f"{row['median_ms']:,.1f}", f"{row['first_ms']:,.0f}",
          f"{baseline[row['size']] / row['median_ms']:.2f}x" if row["size"] in baseline else "-",
          f"{row['error']:.1e}" if "error" in row else ""] for row in rows]))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
