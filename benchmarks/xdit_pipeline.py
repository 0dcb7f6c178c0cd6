"""xDiT's whole FLUX or Wan pipeline (xfuser 0.7.0), prompt to image or clip, on a pipeline directory of
mdtriton/testing/random_pipelines.py: the peer of our served image or clip in benchmarks/served_pipeline.py (its --xdit
rows), or alone here.

xfuser 0.7.0 runs FLUX.1-dev through its model runner (`xfuser/runner.py`; examples/flux_example.py, which used
xFuserFluxPipeline, was removed as deprecated in xDiT #641, and base_pipeline.py calls that wrapper "the legacy pipeline
path"). For Ulysses and Ring its FLUX runner (`model_executor/models/runner_models/flux.py`) loads diffusers'
FluxPipeline with xfuser's `xFuserFlux1Transformer2DWrapper` (the sequence split, USP attention, the gather), sets the
runtime state from `xFuserArgs(...).create_config()`, with --use_torch_compile compiles the transformer with
mode="reduce-overhead" after `_enable_compute_comm_overlap`, and before each call sets the runtime state's input
parameters. Its Wan 2.1 T2V runner (`runner_models/wan.py`, xFuserWan21T2VModel) loads diffusers' WanPipeline in bf16
(the VAE too) with `xFuserWanTransformer3DWrapper` (made with the attention options of its xFuserArgs), compiles the
transformer with torch.compile's default mode, and before each call resets the runtime state's step schedule.
`load_pipeline` and `image` do the same, with three changes for a like-for-like comparison: the transformer gets our
seeded random weights (those `mdtriton build` gives the served transformer: seed 0, made on the same kind of device),
the initial noise comes from a CPU generator seeded with the seed, as our served pipeline draws it (xfuser's runner
draws it on the GPU, which gives other noise), and the directory's scheduler is kept (the Wan runner sets its own
flow shift). Text encoders and VAE are the directory's, in bf16 on GPUs (float32 on the CPU; our served Wan pipeline
decodes in float32, as WanPipeline's model card loads its VAE); the VAE decodes on every rank (xfuser's default,
without --use_parallel_vae). xDiT's CFG parallelism for Wan is not run here.

One process per GPU (NCCL; gloo ranks on the CPU, where xfuser is first patched by benchmarks/xdit_cpu_check.py's
`patch`). Rank 0 times each image or clip by the wall clock from the call to the result as a uint8 array on the host
(the ranks lined up by a barrier first): a first one (compiles), then --images more, the median reported.

Configurations: 1, ulyssesN, ringN, or ulyssesNxringM (xDiT's USP), on as many GPUs as their product.

    python benchmarks/xdit_pipeline.py --configs 1,ulysses4          # FLUX.1-dev size, 1024x1024, 28 steps, GPUs 0..3
    python benchmarks/xdit_pipeline.py --architecture wan --configs ulysses4 --steps 2 --images 1  # Wan 14B, 720p x 81
    python benchmarks/xdit_pipeline.py --tiny --configs 1,ulysses2 --eager   # tiny, on CPU ranks: checks the script

Checked on CPU ranks (tiny, float32, 3 steps): xDiT's Wan clip equals our 1-rank served clip within 1 uint8 level,
uncompiled and compiled, on 1 rank and ulysses 2 (`served_pipeline.py --tiny --architecture wan --plans 1 --xdit
1,ulysses2`); xDiT's FLUX image equals ours exactly uncompiled.

Needs xfuser 0.7.0, yunchang 0.6.4 and distvae 0.1.0: `pip install ".[peers]"` where a package index is reachable
(on the CPU also triton, which xfuser imports and a CPU torch does not bring); see benchmarks/served_pipeline.py for
what a GPU host without one must carry.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mdtriton.build_tools.engine_builder import random_shard
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import family
from mdtriton.families.flux.pipeline import MAX_SEQUENCE_LENGTH as FLUX_MAX_SEQUENCE_LENGTH
from mdtriton.families.wan.pipeline import MAX_SEQUENCE_LENGTH as WAN_MAX_SEQUENCE_LENGTH
from mdtriton.harness import device_name, init_rank, markdown_table, run_ranks
from mdtriton.testing.random_pipelines import (MODEL_SIZES, REQUESTS, add_pipeline_arguments, fill_clip_sizes,
                                               flux_pipeline_dir, pipeline_device, wan_pipeline_dir, work_directory)


@dataclass(frozen=True)
class XDiTJob:
    """What every rank of every configuration runs: images (FLUX) or clips (Wan) on the pipeline directory."""

    architecture: str  # flux or wan
    pipeline_dir: Path
    device_type: str  # cuda (one GPU a rank) or cpu
    compiled: bool
    prompt: str
    height: int
    width: int
    steps: int
    guidance: float
    seed: int
    images: int
    result_dir: Path
    time_limit_s: float = 0  # a configuration's ranks are stopped after this long (0: never), its row failed
    frames: int = 1  # a clip's frames (Wan)


def degrees_of(name: str) -> tuple[int, int]:
    """'1', 'ulyssesN', 'ringN' or 'ulyssesNxringM' -> (Ulysses degree, Ring degree)."""
    match = re.fullmatch(r"1|ulysses(\d+)|ring(\d+)|ulysses(\d+)xring(\d+)", name)
    if not match:
        raise SystemExit(f"unknown peer configuration {name!r}: 1, ulyssesN, ringN or ulyssesNxringM")
    if name == "1":
        return 1, 1
    ulysses, ring, usp_ulysses, usp_ring = match.groups()
    if usp_ulysses:
        return int(usp_ulysses), int(usp_ring)
    return (int(ulysses), 1) if ulysses else (1, int(ring))


def load_pipeline(job: XDiTJob, ulysses: int, ring: int, backend: str, device: torch.device):
    """The pipeline as xfuser 0.7.0's FLUX or Wan 2.1 T2V runner loads it (see the module docstring), with our random
    transformer weights; xfuser's groups and runtime state made first."""
    from accelerate import init_empty_weights
    from diffusers import FluxPipeline, WanPipeline
    from xfuser import xFuserArgs
    from xfuser.core.distributed import initialize_runtime_state, parallel_state
    from xfuser.model_executor.models.runner_models.base_model import xFuserModel
    from xfuser.model_executor.models.runner_models.wan import _build_attention_kwargs
    from xfuser.model_executor.models.transformers.transformer_flux import xFuserFlux1Transformer2DWrapper
    from xfuser.model_executor.models.transformers.transformer_wan import xFuserWanTransformer3DWrapper

    world_size = dist.get_world_size()
    if world_size > 1 and not parallel_state.HAS_LONG_CTX_ATTN:
        raise RuntimeError("xfuser found no usable yunchang, so its sequence-parallel groups would have one rank each")
    parallel_state.init_distributed_environment(rank=dist.get_rank(), world_size=world_size,
                                                local_rank=dist.get_rank(), backend=backend)
    parallel_state.initialize_model_parallel(sequence_parallel_degree=ulysses * ring, ulysses_degree=ulysses,
                                             ring_degree=ring, backend=backend)
    # On GPUs xfuser picks its own attention backend; on the CPU the one xdit_cpu_check.patch gives a log-sum-exp.
    xfuser_args = xFuserArgs(model=str(job.pipeline_dir), ulysses_degree=ulysses, ring_degree=ring,
                             use_torch_compile=job.compiled,
                             attention_backend=None if device.type == "cuda" else "SDPA_EFFICIENT")
    engine_config, _ = xfuser_args.create_config()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = json.loads((job.pipeline_dir / "transformer" / "config.json").read_text())
    config = {key: value for key, value in config.items() if not key.startswith("_")}
    # Parameters on the meta device, to take ours; buffers made as the modules make them (Wan's rotary tables).
    with init_empty_weights(include_buffers=False):
        if job.architecture == "wan":  # as xFuserWan21T2VModel._load_model makes it
            transformer = xFuserWanTransformer3DWrapper(**config, attention_kwargs=_build_attention_kwargs(xfuser_args))
        else:
            transformer = xFuserFlux1Transformer2DWrapper(**config)
    weights = random_shard(job.architecture, config, ParallelPlan(), 0, seed=0, device=device, dtype=dtype)
    transformer.load_state_dict({name: tensor.to(dtype) for name, tensor in weights.items()}, assign=True)
    # Every component in dtype, the Wan VAE too (as xfuser's Wan runner loads it: torch_dtype=torch.bfloat16).
    pipeline_class = WanPipeline if job.architecture == "wan" else FluxPipeline
    pipeline = pipeline_class.from_pretrained(job.pipeline_dir, transformer=transformer, dtype=dtype,
                                              local_files_only=True).to(device)
    pipeline.set_progress_bar_config(disable=True)
    initialize_runtime_state(pipeline, engine_config)
    if job.compiled:  # as the runner's _compile_model does: FLUX.1-dev with reduce-overhead, Wan 2.1 T2V with defaults
        xFuserModel._enable_compute_comm_overlap(None)  # inductor settings only: it reads nothing of the instance
        pipeline.transformer = torch.compile(pipeline.transformer,
                                             mode="reduce-overhead" if job.architecture == "flux" else None)
    return pipeline


def image(pipeline, job: XDiTJob) -> np.ndarray:
    """One image, uint8 [height, width, 3], or clip, uint8 [frames, height, width, 3], on the host, called as xfuser's
    FLUX or Wan runner calls the pipeline, and made uint8 as our served pipeline makes its answer."""
    from xfuser.core.distributed import get_runtime_state

    if job.architecture == "wan":
        get_runtime_state().reset_vsa_schedule_state(job.steps)  # xFuserWanModel.prepare_run
        result = pipeline(prompt=job.prompt, height=job.height, width=job.width, num_frames=job.frames,
                          num_inference_steps=job.steps, guidance_scale=job.guidance,
                          max_sequence_length=WAN_MAX_SEQUENCE_LENGTH,
                          generator=torch.Generator().manual_seed(job.seed), output_type="pt")
    else:
        get_runtime_state().set_input_parameters(batch_size=1, num_inference_steps=job.steps,
                                                 max_condition_sequence_length=FLUX_MAX_SEQUENCE_LENGTH,
                                                 split_text_embed_in_sp=True)
        result = pipeline(prompt=job.prompt, height=job.height, width=job.width, num_inference_steps=job.steps,
                          guidance_scale=job.guidance, max_sequence_length=FLUX_MAX_SEQUENCE_LENGTH,
                          generator=torch.Generator().manual_seed(job.seed), output_type="pt")
    answer = next(iter(family(job.architecture).pipeline.outputs(result).values()))
    return answer[0].cpu().numpy()


def timed_image(pipeline, job: XDiTJob) -> tuple[float, np.ndarray]:
    """Seconds from the call to the uint8 image on the host, every rank starting together, and the image."""
    dist.barrier()
    started = time.perf_counter()
    result = image(pipeline, job)
    return time.perf_counter() - started, result


def start_xdit_rank(rank: int, world_size: int, port: int, cuda: bool) -> torch.device:
    """Begin a rank process that runs xfuser (run_ranks' entry): the environment its groups read, xfuser patched on CPU
    ranks (benchmarks/xdit_cpu_check.py), and a process group even of one rank (xfuser's coordinators need one), not
    bound to the device (its new_group() calls fail when it is). Returns the rank's device."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # xfuser gives each group a gloo twin; loopback surely works
    if not cuda:
        from xdit_cpu_check import patch

        patch()
    return init_rank(rank, world_size, port, cuda, group_of_one=True, bind_device=False)


def _rank_main(rank: int, world_size: int, port: int, job: XDiTJob, ulysses: int, ring: int) -> None:
    cuda = job.device_type == "cuda"
    device = start_xdit_rank(rank, world_size, port, cuda)

    def say(what: str) -> None:  # progress, so that a run cut short by its time limit shows where it was
        if rank == 0:
            print(f"xDiT ulysses {ulysses} x ring {ring}: {what}", flush=True)

    try:
        started = time.perf_counter()
        pipeline = load_pipeline(job, ulysses, ring, "nccl" if cuda else "gloo", device)
        say(f"loaded in {time.perf_counter() - started:.1f} s")
        first_s, first = timed_image(pipeline, job)
        say(f"first result (compiles) in {first_s:.1f} s")
        times = []
        for _ in range(job.images):
            times.append(timed_image(pipeline, job)[0])
            say(f"result {len(times)} of {job.images} in {times[-1]:.2f} s")
        if rank == 0:
            np.save(job.result_dir / "image.npy", first)
            (job.result_dir / "times.json").write_text(json.dumps({"first_s": first_s, "times": times}))
    except BaseException:
        dist.destroy_process_group()
        raise
    # xfuser's groups (each NCCL group with a gloo twin) did not tear down: on 4 x H200 the ranks of ulysses 4 hung in
    # it for the rest of their 330 s after their last image. With the result written, the ranks leave without it.
    os._exit(0)


def run_xdit(name: str, job: XDiTJob) -> dict:
    """One configuration's row, as served_pipeline.py's rows are (the image of seed job.seed under "images"), or its
    failure (failed 1, no times)."""
    return peer_row("xDiT", name, job, _rank_main, "xfuser")


def peer_row(peer: str, name: str, job, rank_main, described: str) -> dict:
    """A peer's configuration `name` (degrees_of) run by rank_main on its ranks, as a row of served_pipeline.py's (the
    image of seed job.seed under "images"), from what its rank 0 wrote in job.result_dir; or its failure (failed 1, no
    times). job: the peer's job (result_dir, time_limit_s, device_type, compiled, seed); described: the peer, for
    the row's description."""
    ulysses, ring = degrees_of(name)
    job.result_dir.mkdir(parents=True, exist_ok=True)
    for stale in job.result_dir.iterdir():
        stale.unlink()
    failure = run_ranks(rank_main, ulysses * ring, (job, ulysses, ring), job.time_limit_s)
    row = {"plan": f"{peer} {name}", "gpus": ulysses * ring, "data_type": "BF16" if job.device_type == "cuda" else "FP32",
           "described": f"{described}, ulysses {ulysses} x ring {ring}, {'compiled' if job.compiled else 'eager'}",
           "failed": 0, "images": {}}
    times_file = job.result_dir / "times.json"
    if not times_file.is_file():
        print(f"{peer} {name}: {failure or 'no result'}", flush=True)
        return {**row, "failed": 1}
    if failure:  # after rank 0 wrote its result: the ranks' ending failed, not the images
        print(f"{peer} {name}: its images were measured, then: {failure}", flush=True)
    measured = json.loads(times_file.read_text())
    row["images"][job.seed] = np.load(job.result_dir / "image.npy")
    return {**row, "first_s": measured["first_s"], "image_s": statistics.median(measured["times"]),
            "image_min_s": min(measured["times"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", choices=("flux", "wan"), default="flux",
                        help="FLUX.1-dev's pipeline (images) or Wan 2.1 T2V 14B's (clips; default flux)")
    parser.add_argument("--configs", default="1,ulysses4", help="xDiT configurations (default 1,ulysses4)")
    parser.add_argument("--eager", action="store_true",
                        help="xDiT uncompiled (default: compiled, as xfuser's --use_torch_compile compiles it)")
    parser.add_argument("--images", type=int, default=10, help="images or clips timed after the first (default 10)")
    parser.add_argument("--frames", type=int, help="a clip's frames (default 81; --tiny: 9)")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="seconds a configuration may take, loading included, before its ranks are stopped and "
                             "its row marked failed (default 0: no limit)")
    add_pipeline_arguments(parser, tiny_steps=3, disk_gb=45)
    args = parser.parse_args()
    fill_clip_sizes(args)
    device = pipeline_device(args, tiny_steps=3)
    names = args.configs.split(",")
    for name in names:
        degrees_of(name)
    flux = args.architecture == "flux"
    with work_directory(args) as workdir:
        make_pipeline_dir = flux_pipeline_dir if flux else wan_pipeline_dir
        pipeline_dir, _ = make_pipeline_dir(workdir / "pipeline", args.tiny, device)
        prompt, guidance = REQUESTS[args.architecture]
        job = XDiTJob(args.architecture, pipeline_dir, device.type, not args.eager, prompt, args.height, args.width,
                      args.steps, guidance, 0, args.images, workdir / "xdit", args.time_limit, args.frames or 1)
        rows = [run_xdit(name, job) for name in names]
    what, size = ("image", f"{args.width}x{args.height}") if flux else ("clip",
                                                                        f"{args.width}x{args.height} x {args.frames}")
    model_size = "tiny" if args.tiny else MODEL_SIZES[args.architecture]
    print(f"\nxDiT's {args.architecture} pipeline ({model_size}), {size}, {args.steps} steps, {device_name(device)}; "
          f"median of {args.images} {what}s after a first one\n")
    print(markdown_table(["configuration", f"time per {what}", f"first {what}"],
                         [[f"{row['plan']} ({row['described']})",
                           f"{row['image_s'] * 1000:,.0f} ms" if not row["failed"] else "failed",
                           f"{row['first_s']:.1f} s" if not row["failed"] else "-"] for row in rows]))
    return 0 if all(not row["failed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
