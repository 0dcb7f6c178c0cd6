"""The peers users would pick instead, measured as `mdtriton bench` measures our engine and in its tables: xDiT
(xfuser) running the FLUX.1 transformer, and yunchang's Ulysses/Ring/USP attention, beside our engine's methods.

Our rows are `mdtriton bench`'s own (mdtriton/bench.py: its arguments, rank processes, rows, error check and tables);
then, for each GPU count, the peers run in their own rank processes on the same GPUs (one process per GPU, NCCL),
in each sequence parallel configuration (ulysses_degree x ring_degree = GPUs):

- forward: one whole transformer forward, the request the FLUX pipeline sends at each size (Family.media_request),
  with the same random weights as ours (mdtriton.harness.bench_weights, loaded by parameter name into xfuser's
  `xFuserFlux1Transformer2DWrapper`, diffusers' FluxTransformer2DModel with xDiT's attention processor: input split
  over the sequence-parallel group, xDiT's USP attention with its own default backend, output all-gathered), as
  xfuser's FLUX.1-dev runner uses it, without the pipeline, VAE or text encoders. --mode compiled (the default)
  compiles xDiT's whole forward with torch.compile's defaults, as xfuser's `--use_torch_compile` does (it compiles at
  the first call of each length and configuration: the "first call ms" column shows that stall); --mode eager runs it
  uncompiled, and our eager variant beside it. Its output at the first size gets the bench's errors against our
  1-GPU output and the float32 forward;
- attention: one block's attention alone (communication included) on every rank's slice of the same q/k/v:
  yunchang's LongContextAttention (Ulysses = u N r 1, Ring = u 1 r N, USP = both) and xDiT's USP function, each with
  its relative error against full attention on one device.

Needs, besides this checkout and torch: diffusers (0.42.1 tested) with its own dependencies (`pip install
".[pipeline]"`), yunchang (0.6.4), xfuser (0.7.0) and distvae (0.1.0) (`pip install ".[peers]"` brings all of
them), all pure-Python wheels (carried: `pip install --no-deps`); einops and triton as a CUDA torch brings them.
flash-attn is not needed: xfuser picks its CUDNN backend (torch's cuDNN attention) where cuDNN is available.

    python benchmarks/xdit_flux.py --gpus 1,4 --methods ulysses --height 1024 --width 1024 --configs ulysses4

yunchang kernels (`--yunchang-attn auto`): torch_cudnn where the ring has one rank (Ulysses), and torch_flash where it
has more, because yunchang 0.6's torch_cudnn (and torch_math) kernels return a log-sum-exp of zeros, which its ring
merge needs (outputs would be wrong; the error column shows it). benchmarks/xdit_cpu_check.py checks this script on
CPU ranks.
"""

from __future__ import annotations

import argparse
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

from mdtriton.bench import (add_arguments, add_errors, communication_timeline, measure, prepare, report, sample_file,
                            save_sample)
from mdtriton.engine.attention.local import plain_attention
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.harness import bench_weights, init_rank, model_config, precision, relative_error, run_ranks, time_calls, \
    timing

# The peers' wheels (diffusers imports requests).
NEEDS = ("diffusers", "requests", "yunchang", "xfuser", "distvae")


def versions() -> dict:
    """The versions of what the rows depend on, for the results."""
    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("diffusers", "xfuser", "yunchang", "distvae", "transformers", "triton", "flash_attn"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    if torch.cuda.is_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def short_error(error: BaseException) -> str:
    """The exception and where it was raised (the last frames), for the results."""
    frames = traceback.extract_tb(error.__traceback__)[-3:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''} [{where}]"


def sp_configs(world_size: int, heads: int, wanted: str) -> list[tuple[int, int]]:
    """(ulysses_degree, ring_degree) pairs with u * r = world_size; Ulysses needs u to divide the heads."""
    pairs = [(u, world_size // u) for u in range(world_size, 0, -1) if world_size % u == 0 and heads % u == 0]
    if wanted != "all" and world_size > 1:
        names = wanted.split(",")
        pairs = [(u, r) for u, r in pairs if config_name(u, r) in names or f"u{u}r{r}" in names]
    return pairs


def config_name(u: int, r: int) -> str:
    if u * r == 1:
        return "1 GPU"
    if r == 1:
        return f"ulysses{u}"
    if u == 1:
        return f"ring{r}"
    return f"usp u{u}r{r}"


def all_ok(ok: bool, device: torch.device) -> bool:
    """Whether every rank succeeded (so that all ranks take the same path after a failure)."""
    if dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], device=device, dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def max_over_ranks(value: float, device: torch.device) -> float:
    if dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def split_sequence(tensor: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    if tensor.shape[dim] % world_size:
        raise ValueError(f"{tensor.shape[dim]} tokens do not divide by {world_size} ranks")
    return tensor.chunk(world_size, dim=dim)[rank].contiguous()


class XDiT:
    """xfuser's distributed state, set up the way its FLUX.1-dev runner sets it up, without a pipeline."""

    def __init__(self, args: argparse.Namespace, config: dict, rank: int, world_size: int):
        importlib.import_module("xfuser")  # imports every pipeline wrapper: fails here if a dependency is missing
        from xfuser.core.distributed import parallel_state

        self.args, self.config, self.ps = args, config, parallel_state
        self.backend_name = "nccl" if args.device == "cuda" else "gloo"
        if not parallel_state.HAS_LONG_CTX_ATTN and world_size > 1:
            raise RuntimeError("xfuser found no usable yunchang (its check_long_ctx_attn failed), so its sequence "
                               "parallel groups would have one rank each")
        parallel_state.init_distributed_environment(rank=rank, world_size=world_size, local_rank=rank,
                                                    backend=self.backend_name)
        self.model = None
        self.backend = None

    def configure(self, u: int, r: int, text_tokens: int) -> None:
        """xfuser's groups for ulysses_degree u x ring_degree r, and its runtime state (attention backend)."""
        from xfuser.config import xFuserArgs
        from xfuser.core.distributed import get_runtime_state, initialize_runtime_state

        # Always anew: yunchang's set_seq_parallel_pg (which xfuser's USP reads its groups from) may have been
        # called for another configuration since.
        if self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()
        self.ps.initialize_model_parallel(sequence_parallel_degree=u * r, ulysses_degree=u, ring_degree=r,
                                          backend=self.backend_name)
        engine_config, _ = xFuserArgs(ulysses_degree=u, ring_degree=r,
                                      attention_backend=self.args.xdit_attention_backend).create_config()
        # The runtime state reads the heads from pipeline.transformer.config (to check ulysses_degree against them).
        pipeline = types.SimpleNamespace(transformer=types.SimpleNamespace(config=types.SimpleNamespace(**self.config)))
        initialize_runtime_state(pipeline, engine_config)
        state = get_runtime_state()
        # What the FLUX runner's set_input_parameters sets, without the pipeline's patch bookkeeping.
        state.max_condition_sequence_length = text_tokens
        state.split_text_embed_in_sp = True
        state.text_embed_sp_pad = 0
        self.backend = state.attention_backend.name

    def build(self, weights: dict) -> None:
        """The transformer as xfuser's FLUX.1-dev runner loads it (after configure: its processors ask for the groups)."""
        from xfuser.model_executor.models.transformers.transformer_flux import xFuserFlux1Transformer2DWrapper

        with torch.device("meta"):
            model = xFuserFlux1Transformer2DWrapper(**self.config)
        model.load_state_dict(weights, assign=True)
        if self.args.mode == "compiled":
            # As xfuser's --use_torch_compile does (base_pipeline.py, _convert_transformer_backbone): the whole
            # forward, torch.compile's defaults; it compiles at its first call of each shape and configuration.
            model.forward = torch.compile(model.forward)
        self.model = model.eval()

    def forward(self, request: dict) -> torch.Tensor:
        return self.model(**request, return_dict=False)[0]

    def usp(self, q, k, v):
        from xfuser.model_executor.layers.usp import USP

        return USP(q, k, v, combine_qkv_a2a=True)


def yunchang_attention(u: int, r: int, attn_type: str, rank: int, world_size: int):
    """yunchang's LongContextAttention (USP; Ulysses when r == 1, Ring when u == 1) over fresh groups."""
    from yunchang import LongContextAttention, set_seq_parallel_pg
    from yunchang.kernels import AttnType

    set_seq_parallel_pg(u, r, rank, world_size)
    return LongContextAttention(ring_impl_type="basic", attn_type=AttnType.from_string(attn_type))


class PeerRank:
    """One rank's peer measurements at one GPU count: rows as `mdtriton bench` makes them, and what failed."""

    def __init__(self, args: argparse.Namespace, rank: int, world_size: int, device: torch.device, work_dir: str):
        self.args, self.rank, self.world_size, self.device, self.work_dir = args, rank, world_size, device, work_dir
        self.cuda = device.type == "cuda"
        self.config = model_config(args)
        self.dtype, _ = precision(device)
        self.requests = {str(size): {name: t.to(device) for name, t in
                                     FLUX.media_request(self.config, 1, size.height, size.width, self.dtype).items()}
                         for size in args.sizes}
        self.tokens = {label: FLUX.request_size(self.config, request).tokens
                       for label, request in self.requests.items()}
        self.rows, self.attention_rows, self.failures = [], [], []

    def attempt(self, what: str, measurement) -> bool:
        """Run measurement(); a failure is recorded as what failed, the same on every rank, and the rest goes on."""
        failure = None
        try:
            measurement()
        except Exception as error:  # noqa: BLE001 - recorded, the other measurements go on
            failure = short_error(error)
            if self.rank == 0:
                traceback.print_exc()
        if all_ok(failure is None, self.device):
            return True
        self.failures.append(f"{what} on {self.world_size} GPU(s): {failure or 'failed on another rank'}")
        return False

    def attention_row(self, method: str, label: str, call, layout: str = "bhsd") -> None:
        """Time one block's attention on this rank's slice; its error against full attention of the same q/k/v."""
        q, k, v = self.qkv(label)
        reference = plain_attention(split_sequence(q, 2, self.rank, self.world_size), k, v)
        with torch.no_grad():
            times, out = time_calls(call, self.cuda, self.args.warmup, 5 * self.args.iterations)
        if layout == "bshd":
            out = out.transpose(1, 2)
        error = max_over_ranks(relative_error(out, reference), self.device)
        self.attention_rows.append({"gpus": self.world_size, "method": method, "size": label,
                                    "tokens": self.tokens[label], "median_ms": timing(times)["median_ms"],
                                    "error": error})

    def qkv(self, label: str) -> tuple[torch.Tensor, ...]:
        """Whole-sequence q, k, v [1, heads, tokens, head_dim], the same on every rank."""
        generator = torch.Generator(self.device).manual_seed(1)
        shape = (1, self.config["num_attention_heads"], self.tokens[label], self.config["attention_head_dim"])
        return tuple(torch.randn(shape, generator=generator, device=self.device, dtype=self.dtype) for _ in range(3))

    def local(self, label: str, layout: str) -> list[torch.Tensor]:
        """This rank's slice of q, k, v: [b, s, h, d] (yunchang's layout), or [b, h, s, d] views of it (USP's)."""
        sliced = [split_sequence(t.transpose(1, 2), 1, self.rank, self.world_size) for t in self.qkv(label)]
        return sliced if layout == "bshd" else [t.transpose(1, 2) for t in sliced]

    def yunchang_rows(self, u: int, r: int) -> None:
        kernels = self.args.yunchang_attn.split(",") if self.args.yunchang_attn != "auto" else \
            ["torch_cudnn" if r == 1 else "torch_flash"]
        for kernel in kernels:
            def rows():
                attention = yunchang_attention(u, r, kernel, self.rank, self.world_size)
                for label in self.requests:
                    local = self.local(label, "bshd")
                    self.attention_row(f"yunchang {config_name(u, r)} ({kernel})", label, lambda: attention(*local),
                                       layout="bshd")
            self.attempt(f"yunchang {config_name(u, r)} ({kernel})", rows)

    def xdit_rows(self, xdit: XDiT, u: int, r: int, weights: dict) -> bool:
        name = f"xDiT {config_name(u, r)}"

        def rows():
            xdit.configure(u, r, next(iter(self.requests.values()))["encoder_hidden_states"].shape[1])
            for label in self.requests:
                local = self.local(label, "bhsd")
                self.attention_row(f"{name} ({xdit.backend})", label, lambda: xdit.usp(*local))
            if xdit.model is None:
                xdit.build(weights)
            for label, request in self.requests.items():
                self.forward_row(name, xdit.backend, label, lambda: xdit.forward(request))
        return self.attempt(name, rows)

    def forward_row(self, method: str, kernel: str, label: str, call) -> None:
        """One forward timed as `mdtriton bench` times ours (a first call apart, then the median), a profiled one on
        GPUs, and the output at the first size kept for the bench's errors."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with torch.no_grad():  # as xDiT's pipelines call it
            first, _ = time_calls(call, self.cuda, 0, 1)  # xDiT's compile at this length shows here
            times, output = time_calls(call, self.cuda, self.args.warmup, self.args.iterations)
            kernels = (communication_timeline(call) if self.cuda else
                       {"communication_share": 0.0, "exposed_ms": [], "idle_ms": [], "compute_ms": [],
                        "kernel_ms_by_kind": {}})
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else 0.0
        self.rows.append({"gpus": self.world_size, "method": method, "variant": self.args.mode, "plan": kernel,
                          "size": label, "tokens": self.tokens[label], **timing(times), "first_ms": first[0],
                          "warm_up_s": 0.0, **kernels, "peak_gib": peak})
        if label == str(self.args.sizes[0]) and self.args.check and self.rank == 0:
            save_sample(output, Path(self.work_dir) / sample_file(self.world_size, method, self.args.mode))


def _peer_rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, work_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    # xfuser gives each of its groups a gloo twin; on one host the loopback interface is the one that surely works.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.setup:  # a check's patches (benchmarks/xdit_cpu_check.py), applied in every rank process
        module, function = args.setup.split(":")
        getattr(importlib.import_module(module), function)()
    # Always a process group, even of one rank: xfuser's group coordinators need one. No device_id: xfuser's
    # comment says NCCL's device-bound rendezvous breaks its new_group() calls.
    cuda = args.device == "cuda"
    device = init_rank(rank, world_size, port, cuda, group_of_one=True, bind_device=False,
                       timeout_s=args.collective_timeout)
    peers = PeerRank(args, rank, world_size, device, work_dir)
    configs = sp_configs(world_size, peers.config["num_attention_heads"], args.configs)
    try:
        if args.yunchang_attention:
            for u, r in configs:
                peers.yunchang_rows(u, r)
        xdit = None

        def set_up():
            nonlocal xdit
            xdit = XDiT(args, peers.config, rank, world_size)
        if peers.attempt("xfuser's set-up", set_up):
            weights = bench_weights("flux", peers.config, ParallelPlan(), 0, device, peers.dtype, None)
            for u, r in configs:
                if not peers.xdit_rows(xdit, u, r, weights):
                    break  # xDiT's state after a failure is unknown: its other configurations are not run
    finally:
        if rank == 0:
            (Path(work_dir) / f"peers-{world_size}.json").write_text(json.dumps(
                {"forward": peers.rows, "attention": peers.attention_rows, "failures": peers.failures}))
        dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, ["flux"])
    parser.set_defaults(gpus="1,2", methods="ulysses,ring,allgather_kv", height="1024", width="1024",
                        output_dir=Path("bench-results/xdit"))
    parser.add_argument("--configs", default="all",
                        help="sequence-parallel configurations of xDiT and yunchang: all (default), or names such as "
                             "ulysses2,ring2,u2r2")
    parser.add_argument("--yunchang-attn", default="auto",
                        help="yunchang AttnType values (torch_cudnn, torch_flash, torch_efficient, fa, ...); "
                             "auto: torch_cudnn without a ring, torch_flash with one")
    parser.add_argument("--no-yunchang-attention", dest="yunchang_attention", action="store_false",
                        help="leave out yunchang's attention rows")
    parser.add_argument("--xdit-attention-backend", default=None,
                        help="xfuser attention backend (default: xfuser's choice, CUDNN where cuDNN is available); "
                             "e.g. SDPA_FLASH, SDPA")
    parser.add_argument("--mode", choices=("compiled", "eager"), default="compiled",
                        help="compiled (default): xDiT with torch.compile as xfuser's --use_torch_compile sets it; "
                             "eager: uncompiled, and our eager variant beside it")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="seconds per GPU count before the peers' ranks are stopped (0: none)")
    parser.add_argument("--collective-timeout", type=float, default=300, help="the peers' process-group timeout, s")
    parser.add_argument("--setup", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.variants = "compiled" if args.mode == "compiled" else "compiled,eager"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prepare(args)
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"not importable: {', '.join(missing)}; pip install '.[peers]' (or carry their wheels and "
                         "pip install --no-deps them)")
    environment = versions()
    print(json.dumps({"environment": environment}), flush=True)
    failures = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as work_dir:
        rows, attention_rows = measure(args, work_dir)
        for world_size in args.counts:
            problem = run_ranks(_peer_rank_main, world_size, (args, work_dir), args.time_limit)
            failures += [problem] if problem else []
            path = Path(work_dir) / f"peers-{world_size}.json"
            if path.exists():
                peers = json.loads(path.read_text())
                rows += peers["forward"]
                attention_rows += peers["attention"]
                failures += peers["failures"]
        add_errors(rows, str(args.sizes[0]), work_dir, args.baseline)
    report(args, rows, attention_rows, {"environment": environment, "failures": failures})
    for failure in failures:
        print(f"could not run: {failure}", flush=True)
    print(f"wall time: {time.monotonic() - began:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
