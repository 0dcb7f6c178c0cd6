"""The peers of our served image or clip (benchmarks/served_pipeline.py's --xdit and --diffusers rows): xDiT's and
diffusers' own whole pipelines, prompt to image or clip, on the same pipeline directory
(mdtriton/testing/random_pipelines.py, random_diffusers_pipelines.py), request (its input images too) and seed, the
transformer with the random weights `mdtriton build` gives the served one (seed 0) where the directory holds none (FLUX,
Wan; the directories of the pipelines served with diffusers' own transformer hold its weights).

- xDiT (FLUX, Wan; xfuser 0.7.0) as its model runner runs FLUX.1-dev (`runner_models/flux.py`) and Wan 2.1 T2V
  (`runner_models/wan.py`): diffusers' FluxPipeline or WanPipeline in bf16 with xfuser's
  `xFuserFlux1Transformer2DWrapper` or `xFuserWanTransformer3DWrapper` (the sequence split, USP attention, the
  gather), the runtime state from `xFuserArgs(...).create_config()`, compiled as its --use_torch_compile compiles
  (FLUX with mode="reduce-overhead" after `_enable_compute_comm_overlap`, Wan with the defaults), the runtime state's
  input parameters (FLUX) or step schedule (Wan) set before each call. Two changes for a like-for-like comparison: the
  initial noise comes from a CPU generator seeded as our served pipeline draws it, and the directory's scheduler is
  kept. The VAE decodes on every rank (xfuser's default). Configurations: 1, ulyssesN, ringN, ulyssesNxringM.
- diffusers (FLUX, Wan, Qwen-Image, Qwen-Image-Edit-Plus, FLUX.2 [dev] and [klein], LTX-2): the directory's pipeline
  class (loaded with what our served pipeline loads it with: Qwen-Image-Edit-Plus's processor), its transformer split
  by diffusers' own context parallelism (`enable_parallelism` with the class's declared plan: Ulysses or Ring in their
  "anything" modes, since a prompt's text tokens need not divide by the ranks), its repeated blocks compiled as our
  served ranks compile them. Configurations: 1, ulyssesN, ringN.

One process per GPU (xDiT: GPUs only; diffusers: gloo ranks on the CPU too), each loading the whole pipeline in bf16
(float32 on the CPU). Rank 0 times each image or clip by the wall clock from the call to the uint8 result on the host
(the ranks lined up by a barrier first): a first one (it compiles), then the ones asked for, the median reported.
xDiT needs xfuser 0.7.0, yunchang 0.6.4 and distvae 0.1.0 (`pip install ".[peers]"`; pure-Python wheels that a GPU
host without a package index can take with `pip install --no-index --no-deps`).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mdtriton.build_tools.engine_builder import random_shard
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import served_part
from mdtriton.families.flux.pipeline import MAX_SEQUENCE_LENGTH as FLUX_MAX_SEQUENCE_LENGTH
from mdtriton.families.wan.pipeline import MAX_SEQUENCE_LENGTH as WAN_MAX_SEQUENCE_LENGTH
from mdtriton.harness import init_rank, run_ranks

# The served pipeline of each architecture the peers run (their outputs are made uint8 as it makes them).
PIPELINES = {"flux": "flux-pipeline", "wan": "wan-pipeline", "qwen-image": "qwen-image-pipeline",
             "qwen-image-edit-plus": "qwen-image-edit-plus-pipeline", "flux2": "flux2-pipeline",
             "flux2-klein": "flux2-klein-pipeline", "ltx2": "ltx2-pipeline"}


@dataclass(frozen=True)
class PeerJob:
    """What every rank of every configuration of a peer runs: images or clips of the request."""

    peer: str  # xDiT or diffusers
    architecture: str  # a key of PIPELINES
    pipeline_dir: Path
    device_type: str  # cuda (one GPU a rank) or cpu
    compiled: bool
    request: dict = field(hash=False)  # the pipeline's call arguments but the generator and the output type
    seed: int
    images: int
    result_dir: Path
    time_limit_s: float = 0  # a configuration's ranks are stopped after this long (0: never), its row failed


def peer_request(architecture: str, prompt: str, guidance: float, height: int, width: int, steps: int,
                 frames: int | None, negative_prompt: str, images: list[np.ndarray]) -> dict:
    """The pipeline's call arguments for our served request: FLUX's and Wan's with their guidance and T5 length (Wan's
    frames), Qwen-Image's and Qwen-Image-Edit-Plus's with their negative prompt and true classifier-free guidance,
    FLUX.2's with its guidance, LTX-2's with its guidance and frames (at its default frame rate, as served); images:
    the input images (uint8 [height, width, 3]), given as the PIL images our served pipeline makes of them."""
    from PIL import Image

    request = dict(prompt=prompt, height=height, width=width, num_inference_steps=steps)
    if images:
        request["image"] = [Image.fromarray(image) for image in images]
    if architecture in ("qwen-image", "qwen-image-edit-plus"):
        return request | dict(negative_prompt=negative_prompt, true_cfg_scale=guidance)
    if architecture == "wan":
        return request | dict(guidance_scale=guidance, num_frames=frames, max_sequence_length=WAN_MAX_SEQUENCE_LENGTH)
    if architecture == "ltx2":
        return request | dict(guidance_scale=guidance, num_frames=frames)
    if architecture in ("flux2", "flux2-klein"):
        return request | dict(guidance_scale=guidance)
    return request | dict(guidance_scale=guidance, max_sequence_length=FLUX_MAX_SEQUENCE_LENGTH)


def degrees_of(name: str) -> tuple[int, int]:
    """'1', 'ulyssesN', 'ringN' or 'ulyssesNxringM' -> (Ulysses degree, Ring degree)."""
    match = re.fullmatch(r"1|ulysses(\d+)|ring(\d+)|ulysses(\d+)xring(\d+)", name)
    if not match:
        raise SystemExit(f"unknown peer configuration {name!r}: 1, ulyssesN, ringN or ulyssesNxringM")
    ulysses, ring, usp_ulysses, usp_ring = match.groups()
    return int(ulysses or usp_ulysses or 1), int(ring or usp_ring or 1)


def start_xdit_rank(rank: int, world_size: int, port: int) -> torch.device:
    """Begin a rank process that runs xfuser on GPU `rank` (run_ranks' entry): the environment its groups read, and a
    process group even of one rank (xfuser's coordinators need one), not bound to the device (its new_group() calls
    fail when it is)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # xfuser gives each group a gloo twin; loopback surely works
    return init_rank(rank, world_size, port, True, group_of_one=True, bind_device=False)


def random_transformer(job: PeerJob, make, device: torch.device, dtype: torch.dtype):
    """make(**the directory's transformer config) with its parameters on the meta device and buffers made as the
    modules make them (Wan's rotary tables), its parameters the random weights the served transformer is built with."""
    from accelerate import init_empty_weights

    config = json.loads((job.pipeline_dir / "transformer" / "config.json").read_text())
    config = {key: value for key, value in config.items() if not key.startswith("_")}
    with init_empty_weights(include_buffers=False):
        transformer = make(**config)
    weights = random_shard(job.architecture, config, ParallelPlan(), 0, seed=0, device=device, dtype=dtype)
    transformer.load_state_dict({name: tensor.to(dtype) for name, tensor in weights.items()}, assign=True)
    return transformer


def xdit_pipeline(job: PeerJob, ulysses: int, ring: int, device: torch.device):
    """The pipeline as xfuser 0.7.0's FLUX or Wan 2.1 T2V runner loads it (the module docstring), with the random
    transformer; xfuser's groups and runtime state made first."""
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
                                                local_rank=dist.get_rank(), backend="nccl")
    parallel_state.initialize_model_parallel(sequence_parallel_degree=ulysses * ring, ulysses_degree=ulysses,
                                             ring_degree=ring, backend="nccl")
    xfuser_args = xFuserArgs(model=str(job.pipeline_dir), ulysses_degree=ulysses, ring_degree=ring,
                             use_torch_compile=job.compiled)
    engine_config, _ = xfuser_args.create_config()
    if job.architecture == "wan":  # as xFuserWan21T2VModel._load_model makes it
        def make(**config):
            return xFuserWanTransformer3DWrapper(**config, attention_kwargs=_build_attention_kwargs(xfuser_args))
    else:
        make = xFuserFlux1Transformer2DWrapper
    transformer = random_transformer(job, make, device, torch.bfloat16)
    # Every component in bf16, the Wan VAE too (as xfuser's Wan runner loads it: torch_dtype=torch.bfloat16).
    pipeline_class = WanPipeline if job.architecture == "wan" else FluxPipeline
    pipeline = pipeline_class.from_pretrained(job.pipeline_dir, transformer=transformer, dtype=torch.bfloat16,
                                              local_files_only=True).to(device)
    initialize_runtime_state(pipeline, engine_config)
    if job.compiled:  # as the runner's _compile_model does: FLUX.1-dev with reduce-overhead, Wan 2.1 T2V with defaults
        xFuserModel._enable_compute_comm_overlap(None)  # inductor settings only: it reads nothing of the instance
        pipeline.transformer = torch.compile(pipeline.transformer,
                                             mode="reduce-overhead" if job.architecture == "flux" else None)
    return pipeline


def diffusers_pipeline(job: PeerJob, ulysses: int, ring: int, device: torch.device):
    """The directory's diffusers pipeline on this rank's device (loaded with what our served pipeline loads it with:
    its part's load_arguments), the random transformer where the directory holds no weights, split by diffusers' own
    context parallelism and compiled as the job says."""
    import diffusers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    index = json.loads((job.pipeline_dir / "model_index.json").read_text())
    components = served_part(PIPELINES[job.architecture]).load_arguments(job.pipeline_dir)
    if not any((job.pipeline_dir / "transformer").glob("*.safetensors")):
        components["transformer"] = random_transformer(job, getattr(diffusers, index["transformer"][1]), device, dtype)
    pipeline = getattr(diffusers, index["_class_name"]).from_pretrained(job.pipeline_dir, torch_dtype=dtype,
                                                                        local_files_only=True, **components).to(device)
    if ulysses * ring > 1:
        pipeline.transformer.enable_parallelism(config=diffusers.ContextParallelConfig(
            ulysses_degree=ulysses if ulysses > 1 else None, ring_degree=ring if ring > 1 else None,
            ulysses_anything=ulysses > 1, ring_anything=ring > 1))
    if job.compiled:
        pipeline.transformer.compile_repeated_blocks(dynamic=True)
    return pipeline


def timed_result(pipeline, job: PeerJob) -> tuple[float, np.ndarray]:
    """Seconds from the call to the uint8 image [height, width, 3] or clip [frames, height, width, 3] on the host,
    every rank starting together, and that result, made uint8 as our served pipeline makes its answer."""
    dist.barrier()
    started = time.perf_counter()
    if job.peer == "xDiT":
        from xfuser.core.distributed import get_runtime_state

        steps = job.request["num_inference_steps"]
        if job.architecture == "wan":
            get_runtime_state().reset_vsa_schedule_state(steps)  # xFuserWanModel.prepare_run
        else:
            get_runtime_state().set_input_parameters(batch_size=1, num_inference_steps=steps,
                                                     max_condition_sequence_length=FLUX_MAX_SEQUENCE_LENGTH,
                                                     split_text_embed_in_sp=True)
    result = pipeline(**job.request, generator=torch.Generator().manual_seed(job.seed), output_type="pt")
    answer = next(iter(served_part(PIPELINES[job.architecture]).outputs(result).values()))[0].cpu().numpy()
    return time.perf_counter() - started, answer


def _rank_main(rank: int, world_size: int, port: int, job: PeerJob, ulysses: int, ring: int) -> None:
    cuda = job.device_type == "cuda"
    if job.peer == "xDiT":
        device = start_xdit_rank(rank, world_size, port)
    else:
        device = init_rank(rank, world_size, port, cuda, group_of_one=True)

    def say(what: str) -> None:  # progress, so that a run cut short by its time limit shows where it was
        if rank == 0:
            print(f"{job.peer} ulysses {ulysses} x ring {ring}: {what}", flush=True)

    try:
        started = time.perf_counter()
        pipeline = (xdit_pipeline if job.peer == "xDiT" else diffusers_pipeline)(job, ulysses, ring, device)
        pipeline.set_progress_bar_config(disable=True)
        say(f"loaded in {time.perf_counter() - started:.1f} s")
        first_s, first = timed_result(pipeline, job)
        say(f"first result (compiles) in {first_s:.1f} s")
        times = []
        for _ in range(job.images):
            times.append(timed_result(pipeline, job)[0])
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


def peer_row(name: str, job: PeerJob) -> dict:
    """The peer's configuration `name` (degrees_of) run on its ranks, as a row of served_pipeline.py's (the image of
    seed job.seed under "images"), from what its rank 0 wrote in job.result_dir; or its failure (failed 1, no times)."""
    ulysses, ring = degrees_of(name)
    job.result_dir.mkdir(parents=True, exist_ok=True)
    for stale in job.result_dir.iterdir():
        stale.unlink()
    failure = run_ranks(_rank_main, ulysses * ring, (job, ulysses, ring), job.time_limit_s)
    described = "xfuser" if job.peer == "xDiT" else "diffusers' enable_parallelism"
    row = {"plan": f"{job.peer} {name}", "gpus": ulysses * ring,
           "data_type": "BF16" if job.device_type == "cuda" else "FP32",
           "described": f"{described}, ulysses {ulysses} x ring {ring}, {'compiled' if job.compiled else 'eager'}",
           "failed": 0, "images": {}}
    times_file = job.result_dir / "times.json"
    if not times_file.is_file():
        print(f"{job.peer} {name}: {failure or 'no result'}", flush=True)
        return {**row, "failed": 1}
    if failure:  # after rank 0 wrote its result: the ranks' ending failed, not the images
        print(f"{job.peer} {name}: its images were measured, then: {failure}", flush=True)
    measured = json.loads(times_file.read_text())
    row["images"][job.seed] = np.load(job.result_dir / "image.npy")
    return {**row, "first_s": measured["first_s"], "image_s": statistics.median(measured["times"]),
            "image_min_s": min(measured["times"])}
