"""The peers users would pick instead, measured like `mdtriton bench`: xDiT (xfuser) running the FLUX.1
transformer, yunchang's Ulysses/Ring/USP attention, and our engine, in the same processes on the same GPUs.

For each GPU count (one process per GPU, NCCL) and each sequence parallel configuration
(ulysses_degree x ring_degree = GPUs):

- forward: one whole transformer forward, FLUX.1-dev size, bf16, batch 1, `--text-tokens` text tokens
  + each `--image-tokens`; the same random weights (mdtriton's seeded generator, loaded by parameter
  name into diffusers' model) and the same inputs (`mdtriton.harness.flux_inputs`) for every
  implementation:
    * xdit: xfuser's `xFuserFlux1Transformer2DWrapper` (diffusers' FluxTransformer2DModel with xDiT's
      attention processor: input split over the sequence-parallel group, xDiT's USP attention with its
      own default backend, output all-gathered), as xfuser's FLUX.1-dev runner uses it, without the
      pipeline, VAE or text encoders;
    * mdtriton: our engine (`--ours` methods);
  both compiled by default (`--mode compiled`), each the way it recommends: xDiT's whole forward through
  torch.compile with its defaults, as xfuser's `--use_torch_compile` does (it compiles at its first call of
  each length and configuration: the "first call ms" column shows that stall), and our engine as the server
  runs it (projections fused, blocks compiled and warmed up at load, short requests replayed as CUDA graphs);
  `--mode eager` runs both uncompiled;
- attention: one block's attention alone on the same q/k/v (24 heads x 128, bf16), each rank holding
  its contiguous slice of the joint sequence, communication included: our methods, yunchang's
  LongContextAttention (Ulysses = u N r 1, Ring = u 1 r N, USP = both) and xDiT's USP function, with
  the relative error of each output against full attention on one device.

Built on the benchmark harness (mdtriton/harness.py), as `mdtriton bench` is: our engine is loaded as the server
loads it (TorchEngine.from_weights) and timed through its forward; timing by its timer: warm-up calls, then
CUDA-event times of calls lined up by a barrier; the median is reported. Every implementation shares one set of
weight tensors per GPU (23.8 GB for FLUX.1-dev). Attention rows come first (they are cheap), then forwards length by length, every
implementation at each length, so a run stopped by --time-limit loses only its longest lengths. Rank 0
appends every row to OUTPUT_DIR/rows.jsonl as soon as it is measured; at the end the tables go to
stdout, results.md and results.json. Forward outputs at --check-tokens are compared with our 1-GPU output.

Needs, besides this checkout and torch: diffusers (0.42.1 tested) with its own dependencies (`pip install
".[pipeline]"` brings them, requests among them, which diffusers imports) and yunchang (0.6.4); for xdit also
xfuser (0.7.0) and distvae (0.1.0) (`pip install ".[peers]"` brings all of them), all pure-Python wheels (carried:
`pip install --no-deps`; xfuser's other declared dependencies, av and beautifulsoup4, are not imported on this
path); transformers, accelerate, peft, einops, sentencepiece and triton as a CUDA torch brings or has beside it. On a host without a package
index, carry the wheels of all of them (requests' too: requests, charset-normalizer, idna, urllib3, certifi).
flash-attn is not needed: xfuser picks its CUDNN backend (torch's cuDNN attention) where cuDNN is available.

    PYTHONPATH=$PWD:/tmp/xdit python benchmarks/xdit_flux.py --gpus 1,2 --image-tokens 4096,16384

Compiled xDiT's ring2 against our two best methods on 2 GPUs (xDiT compiles at 4k and again, with symbolic
sizes, at 16k; compiling diffusers' whole FLUX.1-dev transformer took 90 s and 130 s at those lengths on one H200):

    python benchmarks/xdit_flux.py --gpus 2 --parts forward --ours allgather_kv,tp --configs ring2 \\
        --image-tokens 4096,16384,65536

yunchang kernels (`--yunchang-attn auto`): torch_cudnn where the ring has one rank (Ulysses), and
torch_flash where it has more, because yunchang 0.6's torch_cudnn (and torch_math) kernels return a
log-sum-exp of zeros, which its ring merge needs (outputs would be wrong; the error column shows it).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/xdit_flux.py` from anywhere
    sys.path.insert(0, str(REPO))

from mdtriton.engine.plan import ParallelPlan  # noqa: E402
from mdtriton.families.flux import FLUX  # noqa: E402
from mdtriton.harness import (attention_flops, bench_engine, flux_inputs, init_rank, markdown_table,  # noqa: E402
                              plans_for, relative_error, run_ranks, time_calls, timing, write_results)

IMPLS = ("xdit", "mdtriton")
# What each implementation needs importable, and the wheel that carries it (diffusers imports requests).
NEEDS = {
    "xdit": ("diffusers", "requests", "yunchang", "xfuser", "distvae"),
    "yunchang": ("yunchang",),
}


# ----------------------------------------------------------------------------------------------------
# Environment


def missing_modules(names) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def versions() -> dict:
    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist_name in ("diffusers", "xfuser", "yunchang", "distvae", "transformers", "huggingface_hub", "triton",
                      "flash_attn", "requests"):
        try:
            found[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            found[dist_name] = None
    if torch.cuda.is_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        found["cudnn"] = torch.backends.cudnn.version()
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def short_error(error: BaseException) -> str:
    """The exception and where it was raised (the last frames), for the results table and JSON."""
    frames = traceback.extract_tb(error.__traceback__)[-3:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''} [{where}]"


# ----------------------------------------------------------------------------------------------------
# Configurations


def sp_configs(world_size: int, heads: int, wanted: str) -> list[tuple[int, int]]:
    """(ulysses_degree, ring_degree) pairs with u * r = world_size; Ulysses needs u to divide the heads."""
    pairs = [(u, world_size // u) for u in range(world_size, 0, -1) if world_size % u == 0 and heads % u == 0]
    if wanted != "all" and world_size > 1:
        keep = {config_name(u, r) for u, r in pairs if config_name(u, r) in wanted.split(",")}
        keep |= {config_name(u, r) for u, r in pairs if f"u{u}r{r}" in wanted.split(",")}
        pairs = [(u, r) for u, r in pairs if config_name(u, r) in keep]
    return pairs


def config_name(u: int, r: int) -> str:
    if u * r == 1:
        return "1 GPU"
    if r == 1:
        return f"ulysses{u}"
    if u == 1:
        return f"ring{r}"
    return f"usp u{u}r{r}"


def yunchang_attn_types(ring_degree: int, wanted: str) -> list[str]:
    if wanted == "auto":
        return ["torch_cudnn" if ring_degree == 1 else "torch_flash"]
    return wanted.split(",")


# ----------------------------------------------------------------------------------------------------
# Recording (rank 0)


class Recorder:
    def __init__(self, rank: int, output_dir: Path, work_dir: Path):
        self.rank = rank
        self.path = output_dir / "rows.jsonl"
        self.work_dir = work_dir

    def row(self, **row) -> None:
        if self.rank != 0:
            return
        row["time"] = datetime.datetime.now().isoformat(timespec="seconds")
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def sample(self, name: str, tensor: torch.Tensor) -> None:
        if self.rank == 0:
            torch.save(tensor.detach().float().cpu(), self.work_dir / f"sample-{name}.pt")


def all_ok(ok: bool, device: torch.device) -> bool:
    """Whether every rank succeeded (so that all ranks take the same path after a failure)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], device=device, dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def max_over_ranks(value: float, device: torch.device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(call, cuda: bool, warmup: int, iterations: int) -> tuple[dict, object]:
    times, result = time_calls(call, cuda, warmup, iterations)
    return {**timing(times), "times_ms": [round(t, 3) for t in times]}, result


# ----------------------------------------------------------------------------------------------------
# Shared material


def flux_weights(config: dict, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The whole model's seeded random weights (mdtriton's generator, seed 0): the same as `mdtriton bench`."""
    from mdtriton.build_tools.engine_builder import random_shard

    return random_shard("flux", config, ParallelPlan(), 0, seed=0, device=device, dtype=dtype)


def attention_qkv(config: dict, tokens: int, device: torch.device, dtype: torch.dtype):
    """Whole-sequence q, k, v [1, heads, tokens, head_dim], the same on every rank."""
    generator = torch.Generator(device).manual_seed(1)
    shape = (1, config["num_attention_heads"], tokens, config["attention_head_dim"])
    return tuple(torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(3))


def split_sequence(tensor: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    if tensor.shape[dim] % world_size:
        raise ValueError(f"{tensor.shape[dim]} tokens do not divide by {world_size} ranks")
    return tensor.chunk(world_size, dim=dim)[rank].contiguous()


# ----------------------------------------------------------------------------------------------------
# Attention alone


def attention_case(ctx, tokens: int):
    """q, k, v for the whole sequence and full attention for this rank's queries (the reference)."""
    from mdtriton.engine.attention.local import plain_attention

    q, k, v = attention_qkv(ctx.config, tokens, ctx.device, ctx.dtype)
    return (q, k, v), plain_attention(split_sequence(q, 2, ctx.rank, ctx.world_size), k, v)


def attention_row(ctx, impl: str, config: str, kernel: str, tokens: int, call, reference, layout: str = "bhsd"):
    """Time call(), compare its output (this rank's queries) with the reference, record one row."""
    args = ctx.args
    grad = torch.inference_mode() if impl in ("mdtriton", "torch") else torch.no_grad()
    with grad:
        stats, out = measure(call, ctx.cuda, args.warmup, args.attention_iterations)
    if layout == "bshd":
        out = out.transpose(1, 2)
    error = max_over_ranks(relative_error(out, reference), ctx.device)
    ctx.rec.row(part="attention", impl=impl, gpus=ctx.world_size, config=config, kernel=kernel, tokens=tokens,
                rel_error=error, **stats)


def attention_mdtriton(ctx) -> None:
    from mdtriton.engine.attention import attention_for
    from mdtriton.engine.attention.local import cudnn_sdpa, plain_attention

    rank, ws = ctx.rank, ctx.world_size
    for name, plan in ctx.our_plans.items():
        comm = ctx.comm(name)
        attention = attention_for(plan)
        for tokens in ctx.joint_lengths:
            (q, k, v), reference = attention_case(ctx, tokens)
            heads = slice(plan.tp_rank(rank) * q.shape[1] // plan.tp_size,
                          (plan.tp_rank(rank) + 1) * q.shape[1] // plan.tp_size)
            local = [split_sequence(t[:, heads], 2, plan.cp_rank(rank), plan.cp_size) for t in (q, k, v)]
            if plan.tp_size > 1:  # this rank's heads of the whole sequence
                reference = plain_attention(local[0], k[:, heads], v[:, heads])
            attention_row(ctx, "mdtriton", name, "FA3 where available, else SDPA (cuDNN first)", tokens,
                          lambda: attention(*local, comm, tokens), reference)
    if ws == 1:
        for tokens in ctx.joint_lengths:
            (q, k, v), reference = attention_case(ctx, tokens)
            attention_row(ctx, "torch", "cuDNN SDPA", "cuDNN", tokens, lambda: cudnn_sdpa(q, k, v), reference)


def attention_yunchang(ctx) -> None:
    rank, ws = ctx.rank, ctx.world_size
    for u, r in ctx.configs:
        for attn_type in yunchang_attn_types(r, ctx.args.yunchang_attn):
            name, failure = config_name(u, r), None
            try:
                attention = yunchang_attention(u, r, attn_type, rank, ws)
                for tokens in ctx.joint_lengths:
                    (q, k, v), reference = attention_case(ctx, tokens)
                    # yunchang's layout: [batch, sequence, heads, head_dim].
                    local = [split_sequence(t.transpose(1, 2), 1, rank, ws) for t in (q, k, v)]
                    attention_row(ctx, "yunchang", name, attn_type, tokens, lambda: attention(*local), reference,
                                  layout="bshd")
            except Exception as error:  # noqa: BLE001 - recorded, the other measurements go on
                failure = short_error(error)
                if rank == 0:
                    traceback.print_exc()
            # Failures are the same on every rank (same code, same shapes); agree before the next collective.
            if not all_ok(failure is None, ctx.device):
                ctx.rec.row(part="error", impl="yunchang", gpus=ws, config=name, kernel=attn_type,
                            message=failure or "failed on another rank")


def attention_xdit(ctx, xdit) -> str | None:
    rank, ws = ctx.rank, ctx.world_size
    for u, r in ctx.configs:
        name, failure = config_name(u, r), None
        try:
            xdit.configure(u, r)
            for tokens in ctx.joint_lengths:
                (q, k, v), reference = attention_case(ctx, tokens)
                # As xDiT's FLUX processor calls USP: [batch, heads, sequence, head_dim] views of [b, s, h, d].
                local = [split_sequence(t.transpose(1, 2), 1, rank, ws).transpose(1, 2) for t in (q, k, v)]
                attention_row(ctx, "xdit", name, xdit.backend, tokens, lambda: xdit.usp(*local), reference)
        except Exception as error:  # noqa: BLE001
            failure = short_error(error)
            if rank == 0:
                traceback.print_exc()
        if not all_ok(failure is None, ctx.device):
            reason = f"xDiT's USP attention failed at {name}: {failure or 'on another rank'}"
            ctx.rec.row(part="error", impl="xdit", gpus=ws, config=name, message=reason)
            return reason
    return None


# ----------------------------------------------------------------------------------------------------
# Whole forwards


def forward_row(ctx, impl: str, config: str, kernel: str, inputs: dict, image_tokens: int, call, **extra) -> None:
    args = ctx.args
    grad = torch.inference_mode() if impl == "mdtriton" else torch.no_grad()  # xDiT's pipelines use no_grad
    with grad:
        first, _ = time_calls(call, ctx.cuda, 0, 1)  # a compile at this length (xDiT's) shows here
        stats, out = measure(call, ctx.cuda, args.warmup, args.iterations)
    ctx.rec.row(part="forward", impl=impl, gpus=ctx.world_size, config=config, kernel=kernel, mode=args.mode,
                image_tokens=image_tokens, text_tokens=args.text_tokens, first_ms=first[0], **extra, **stats)
    if image_tokens in args.check_tokens:
        ctx.rec.sample(f"{impl}-{ctx.world_size}-{config}-{image_tokens}", out)


class OurModels:
    """Our engine per method; context-parallel plans share one set of weight tensors (those of every peer)."""

    def __init__(self, ctx, weights: dict):
        self.ctx, self.weights, self.engines = ctx, weights, {}

    def forward_all(self, inputs: dict, image_tokens: int) -> None:
        ctx = self.ctx
        for name, plan in ctx.our_plans.items():
            if name not in self.engines:
                self.engines[name] = self.build(name, plan)
            engine = self.engines[name]
            forward_row(ctx, "mdtriton", name, str(plan), inputs, image_tokens,
                        lambda: engine.forward(inputs)["sample"], warm_up_s=engine.warm_up_seconds)

    def build(self, name: str, plan: ParallelPlan):
        """The plan's engine, loaded as the server loads it: compiled mode as the server runs it (projections fused,
        blocks compiled and warmed up at load, short requests replayed as CUDA graphs); eager mode the same module
        uncompiled."""
        from mdtriton.build_tools.engine_builder import random_shard

        ctx = self.ctx
        # The engine empties the dict it is given: the shared tensors go in a dict of their own.
        weights = dict(self.weights) if plan.tp_size == 1 else random_shard(
            "flux", ctx.config, plan, ctx.rank, seed=0, device=ctx.device, dtype=ctx.dtype)
        return bench_engine("flux", ctx.config, ctx.comm(name), weights, "BF16" if ctx.cuda else "FP32",
                            compiled=ctx.args.mode == "compiled")


# ----------------------------------------------------------------------------------------------------
# yunchang


def yunchang_attention(u: int, r: int, attn_type: str, rank: int, world_size: int):
    """yunchang's LongContextAttention (USP; Ulysses when r == 1, Ring when u == 1) over fresh groups."""
    from yunchang import LongContextAttention, set_seq_parallel_pg
    from yunchang.kernels import AttnType

    set_seq_parallel_pg(u, r, rank, world_size)
    return LongContextAttention(ring_impl_type="basic", attn_type=AttnType.from_string(attn_type))


# ----------------------------------------------------------------------------------------------------
# xDiT


class XDiT:
    """xfuser's distributed state, set up the way its FLUX.1-dev runner sets it up, without a pipeline."""

    def __init__(self, ctx):
        importlib.import_module("xfuser")  # imports every pipeline wrapper: fails here if a dependency is missing
        from xfuser.core.distributed import parallel_state

        self.ctx = ctx
        self.ps = parallel_state
        if not parallel_state.HAS_LONG_CTX_ATTN and ctx.world_size > 1:
            raise RuntimeError("xfuser found no usable yunchang (its check_long_ctx_attn failed), so its sequence "
                               "parallel groups would have one rank each")
        parallel_state.init_distributed_environment(rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank,
                                                    backend=ctx.backend)
        self.model = None

    def configure(self, u: int, r: int) -> None:
        """xfuser's groups for ulysses_degree u x ring_degree r, and its runtime state (attention backend)."""
        from xfuser.config import xFuserArgs
        from xfuser.core.distributed import get_runtime_state, initialize_runtime_state

        # Always anew: yunchang's set_seq_parallel_pg (which xfuser's USP reads its groups from) may have been
        # called for another configuration since.
        ps, ctx = self.ps, self.ctx
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(sequence_parallel_degree=u * r, ulysses_degree=u, ring_degree=r,
                                     backend=ctx.backend)
        engine_config, _ = xFuserArgs(ulysses_degree=u, ring_degree=r,
                                      attention_backend=ctx.args.xdit_attention_backend).create_config()
        # The runtime state reads the heads from pipeline.transformer.config (to check ulysses_degree against them).
        pipeline = types.SimpleNamespace(transformer=types.SimpleNamespace(config=types.SimpleNamespace(**ctx.config)))
        initialize_runtime_state(pipeline, engine_config)
        state = get_runtime_state()
        # What the FLUX runner's set_input_parameters sets, without the pipeline's patch bookkeeping.
        state.max_condition_sequence_length = ctx.args.text_tokens
        state.split_text_embed_in_sp = True
        state.text_embed_sp_pad = 0
        self.backend = state.attention_backend.name

    def build(self, weights: dict) -> None:
        """The transformer as xfuser's FLUX.1-dev runner loads it (after configure: its processors ask for the groups)."""
        from xfuser.model_executor.models.transformers.transformer_flux import xFuserFlux1Transformer2DWrapper

        with torch.device("meta"):
            model = xFuserFlux1Transformer2DWrapper(**self.ctx.config)
        model.load_state_dict(weights, assign=True)
        if self.ctx.args.mode == "compiled":
            # As xfuser's --use_torch_compile does (base_pipeline.py, _convert_transformer_backbone): the whole
            # forward, torch.compile's defaults; it compiles at its first call of each shape and configuration.
            model.forward = torch.compile(model.forward)
        self.model = model.eval()

    def usp(self, q, k, v):
        from xfuser.model_executor.layers.usp import USP

        return USP(q, k, v, combine_qkv_a2a=True)

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.model(**inputs, return_dict=False)[0]

    def forward_all(self, inputs: dict, image_tokens: int, weights: dict) -> str | None:
        ctx = self.ctx
        for u, r in ctx.configs:
            name, failure = config_name(u, r), None
            try:
                self.configure(u, r)
                if self.model is None:
                    self.build(weights)
                forward_row(ctx, "xdit", name, self.backend, inputs, image_tokens, lambda: self.forward(inputs))
            except Exception as error:  # noqa: BLE001
                failure = short_error(error)
                if ctx.rank == 0:
                    traceback.print_exc()
            if not all_ok(failure is None, ctx.device):
                reason = f"xDiT failed at {name}, {image_tokens} image tokens: {failure or 'on another rank'}"
                ctx.rec.row(part="error", impl="xdit", gpus=ctx.world_size, config=name, message=reason)
                return reason
        return None


def setup_xdit(ctx):
    """(XDiT, None) or (None, why xDiT cannot run), the same answer on every rank."""
    xdit, failure = None, None
    try:
        xdit = XDiT(ctx)
    except Exception as error:  # noqa: BLE001
        failure = short_error(error)
        if ctx.rank == 0:
            traceback.print_exc()
    if all_ok(failure is None, ctx.device):
        return xdit, None
    reason = f"xfuser could not be set up: {failure or 'failed on another rank'}"
    ctx.rec.row(part="error", impl="xdit", gpus=ctx.world_size, config="setup", message=reason)
    return None, reason


# ----------------------------------------------------------------------------------------------------
# One process per GPU


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, work_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    # xfuser gives each of its groups a gloo twin; on one host the loopback interface is the one that surely works.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.setup:  # a test's patches (benchmarks/xdit_cpu_check.py), applied in every rank process
        module, function = args.setup.split(":")
        getattr(importlib.import_module(module), function)()
    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    # Always a process group, even of one rank: xfuser's group coordinators need one. No device_id: xfuser's
    # comment says NCCL's device-bound rendezvous breaks its new_group() calls.
    device = init_rank(rank, world_size, port, cuda, group_of_one=True, bind_device=False,
                       timeout_s=args.collective_timeout)
    config = {**FLUX.presets()[args.preset], **json.loads(args.config)}
    ctx = types.SimpleNamespace(
        args=args, rank=rank, local_rank=rank, world_size=world_size, device=device, cuda=cuda, backend=backend,
        dtype=torch.bfloat16 if cuda else torch.float32, config=config,
        rec=Recorder(rank, args.output_dir, Path(work_dir)),
        configs=sp_configs(world_size, config["num_attention_heads"], args.configs),
        joint_lengths=[n + args.text_tokens for n in args.image_tokens],
        our_plans=plans_for(world_size, args.ours) if "mdtriton" in args.impls else {})
    communicators = {}

    def comm(name):  # one Communicator (and its groups) per plan, made once, by every rank in the same order
        from mdtriton.engine.comm import Communicator

        if name not in communicators:
            communicators[name] = Communicator(ctx.our_plans[name], rank, device)
            communicators[name].join_groups()
        return communicators[name]

    ctx.comm = comm
    if rank == 0:
        print(f"[{world_size} GPU(s)] sequence-parallel configurations: "
              f"{', '.join(config_name(u, r) for u, r in ctx.configs)}", flush=True)
    try:
        xdit, reason = setup_xdit(ctx) if "xdit" in args.impls else (None, None)
        if "attention" in args.parts:
            attention_mdtriton(ctx)
            if xdit is not None:
                reason = attention_xdit(ctx, xdit)
            if args.yunchang_attention:
                attention_yunchang(ctx)
        if "forward" in args.parts:
            # One set of weights for every implementation: mdtriton's seeded random weights, by diffusers' names.
            weights = flux_weights(config, device, ctx.dtype)
            ours = OurModels(ctx, weights) if ctx.our_plans else None
            # Length by length, every implementation at each: a run stopped by --time-limit loses the longest only.
            for image_tokens in args.image_tokens:
                inputs = flux_inputs(config, args.text_tokens, image_tokens, device)
                if ours is not None:
                    ours.forward_all(inputs, image_tokens)
                if xdit is not None and reason is None:
                    reason = xdit.forward_all(inputs, image_tokens, weights)
                del inputs
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# Tables


def add_errors(rows: list[dict], work_dir: Path) -> None:
    """Forward outputs at --check-tokens against our 1-GPU bf16 output (same weights, same inputs)."""
    for row in rows:
        if row.get("part") != "forward":
            continue
        path = work_dir / f"sample-{row['impl']}-{row['gpus']}-{row['config']}-{row['image_tokens']}.pt"
        reference = work_dir / f"sample-mdtriton-1-1 GPU-{row['image_tokens']}.pt"
        if path.exists() and reference.exists():
            row["error_vs_mdtriton_1gpu"] = relative_error(torch.load(path), torch.load(reference))


def forward_table(rows: list[dict]) -> str:
    rows = [r for r in rows if r.get("part") == "forward"]
    single = {(r["impl"], r["image_tokens"]): r["median_ms"] for r in rows if r["gpus"] == 1}
    best_ours = {}
    for r in rows:
        if r["impl"] == "mdtriton":
            key = (r["gpus"], r["image_tokens"])
            best_ours[key] = min(best_ours.get(key, float("inf")), r["median_ms"])
    header = ["image+text tokens", "GPUs", "implementation", "mode", "configuration", "attention kernel / plan",
              "median ms", "first call ms", "speedup over its 1 GPU", "mdtriton best / this",
              "rel. error vs mdtriton 1 GPU"]
    cells = []
    for r in sorted(rows, key=lambda r: (r["image_tokens"], r["gpus"], r["impl"], r["config"])):
        base = single.get((r["impl"], r["image_tokens"]))
        speedup = f"{base / r['median_ms']:.2f}x" if base else ""
        ours = best_ours.get((r["gpus"], r["image_tokens"]))
        ratio = f"{ours / r['median_ms']:.2f}" if ours else ""
        error = f"{r['error_vs_mdtriton_1gpu']:.1e}" if "error_vs_mdtriton_1gpu" in r else ""
        cells.append([f"{r['image_tokens']:,}+{r['text_tokens']}", r["gpus"], r["impl"], r["mode"], r["config"],
                      r.get("kernel", ""), f"{r['median_ms']:.1f}", f"{r['first_ms']:.0f}", speedup, ratio, error])
    return markdown_table(header, cells)


def attention_table(rows: list[dict], config: dict) -> str:
    rows = [r for r in rows if r.get("part") == "attention"]
    cudnn = {r["tokens"]: r["median_ms"] for r in rows if r["config"] == "cuDNN SDPA"}
    header = ["image+text tokens", "GPUs", "implementation", "configuration", "kernel", "median ms",
              "TFLOP/s per GPU", "% of 1-GPU cuDNN rate", "rel. error vs full attention"]
    cells = []
    for r in sorted(rows, key=lambda r: (r["tokens"], r["gpus"], r["impl"], r["config"])):
        flops = attention_flops(r["tokens"], FLUX.attention_shape(config))
        tflops = flops / r["gpus"] / r["median_ms"] / 1e9
        share = f"{100 * tflops / (flops / cudnn[r['tokens']] / 1e9):.0f}%" if r["tokens"] in cudnn else ""
        cells.append([f"{r['tokens']:,}", r["gpus"], r["impl"], r["config"], r["kernel"], f"{r['median_ms']:.2f}",
                      f"{tflops:.0f}", share, f"{r['rel_error']:.1e}"])
    return markdown_table(header, cells)


# ----------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="1,2", help="GPU counts (default 1,2; 1 is every implementation's baseline)")
    parser.add_argument("--image-tokens", default="4096,16384", help="image sequence lengths (default 4096,16384)")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--parts", default="attention,forward", help="attention and/or forward (default both)")
    parser.add_argument("--impls", default="xdit,mdtriton",
                        help=f"forward implementations among {','.join(IMPLS)} (default xdit,mdtriton)")
    parser.add_argument("--no-yunchang-attention", dest="yunchang_attention", action="store_false",
                        help="leave out the yunchang attention-only rows")
    parser.add_argument("--ours", default="allgather_kv,ring,ulysses",
                        help="mdtriton methods (default allgather_kv,ring,ulysses; also tp, tp_cp)")
    parser.add_argument("--configs", default="all",
                        help="sequence-parallel configurations for xdit and yunchang: all (default), or names "
                             "such as ulysses2,ring2,u2r2")
    parser.add_argument("--yunchang-attn", default="auto",
                        help="yunchang AttnType values (torch_cudnn, torch_flash, torch_efficient, fa, ...); "
                             "auto: torch_cudnn without a ring, torch_flash with one")
    parser.add_argument("--xdit-attention-backend", default=None,
                        help="xfuser attention backend (default: xfuser's choice, CUDNN where cuDNN is available); "
                             "e.g. SDPA_FLASH, SDPA")
    parser.add_argument("--mode", choices=("compiled", "eager"), default="compiled",
                        help="compiled (default): our engine as served and xDiT with torch.compile as xfuser's "
                             "--use_torch_compile sets it; eager: both uncompiled")
    parser.add_argument("--preset", default="flux.1-dev", choices=sorted(FLUX.presets()))
    parser.add_argument("--config", default="{}", help="JSON overriding the preset's config")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3, help="timed forwards (default 3)")
    parser.add_argument("--attention-iterations", type=int, default=10, help="timed attention calls (default 10)")
    parser.add_argument("--check-tokens", default="4096",
                        help="image lengths at which forward outputs are compared with mdtriton's 1-GPU output")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results/xdit"))
    parser.add_argument("--time-limit", type=float, default=0,
                        help="seconds per GPU count before its ranks are stopped (0: none); rows measured "
                             "until then are kept")
    parser.add_argument("--collective-timeout", type=float, default=300, help="process-group timeout, seconds")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu: gloo ranks in float32, for checking the script (use the tiny preset)")
    parser.add_argument("--setup", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.gpus = [int(g) for g in args.gpus.split(",")]
    args.image_tokens = [int(n) for n in args.image_tokens.split(",")]
    args.check_tokens = [int(n) for n in args.check_tokens.split(",") if n]
    args.parts = args.parts.split(",")
    args.impls = [i for i in args.impls.split(",") if i]
    args.ours = [m for m in args.ours.split(",") if m]
    for impl in args.impls:
        if impl not in IMPLS:
            parser.error(f"unknown implementation {impl!r}; choose among {', '.join(IMPLS)}")
    for part in args.parts:
        if part not in ("attention", "forward"):
            parser.error(f"unknown part {part!r}; choose attention and/or forward")
    return args


def preflight(args: argparse.Namespace) -> None:
    """Refuse at once, with what to do, instead of failing (or hanging) inside the ranks."""
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible; use --device cpu --preset tiny for a functional check")
        if max(args.gpus) > torch.cuda.device_count():
            raise SystemExit(f"asked for {max(args.gpus)} GPUs, {torch.cuda.device_count()} visible")
    wanted = set(NEEDS["yunchang"]) if "attention" in args.parts and args.yunchang_attention else set()
    for impl in args.impls:
        wanted |= set(NEEDS.get(impl, ()))
    missing = missing_modules(sorted(wanted))
    hard = [m for m in missing if m in ("diffusers", "yunchang")]
    if hard:
        raise SystemExit(f"not importable: {', '.join(hard)}. Install the wheels first, e.g. "
                         "python3 -m pip install --no-index --no-deps --target /tmp/xdit .whl-xdit/*.whl and put "
                         "/tmp/xdit on PYTHONPATH")
    if missing:  # xfuser or distvae: xdit cannot run; our rows still can
        print(f"warning: not importable: {', '.join(missing)}: xdit will be recorded as failed", flush=True)
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        if args.device == "cuda" and name in os.environ:
            print(f"{name}={os.environ[name]}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    preflight(args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "rows.jsonl").unlink(missing_ok=True)
    environment = versions()
    print(json.dumps({"environment": environment}), flush=True)
    config = {**FLUX.presets()[args.preset], **json.loads(args.config)}
    problems = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as work_dir:
        for world_size in sorted(set(args.gpus)):
            problem = run_ranks(_rank_main, world_size, (args, work_dir), args.time_limit)
            if problem:
                print(f"warning: {problem}", flush=True)
                problems.append(problem)
        rows_path = args.output_dir / "rows.jsonl"
        rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
        add_errors(rows, Path(work_dir))
    errors = [r for r in rows if r.get("part") == "error"]
    text = (f"Environment: {json.dumps(environment)}\n\n"
            f"One forward of the whole transformer ({args.preset}, batch 1, {'bf16' if args.device == 'cuda' else 'fp32'}):"
            f"\n\n{forward_table(rows)}\n\n"
            f"One block's attention alone (communication included):\n\n{attention_table(rows, config)}\n")
    if errors or problems:
        text += "\nWhat could not run:\n\n" + "\n".join(
            [f"- {r['impl']} ({r['gpus']} GPU(s), {r['config']}): {r['message']}" for r in errors]
            + [f"- {p}" for p in problems]) + "\n"
    text += f"\nWall time: {time.monotonic() - began:.0f} s\n"
    print(text)
    write_results(args.output_dir, text, {
        "environment": environment, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows, "problems": problems})
    print(f"wrote {args.output_dir / 'results.md'} and results.json", flush=True)
    return 1 if problems and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
