"""diffusers' own whole Qwen-Image pipeline on 1 to N GPUs, its transformer split by diffusers' own context parallelism
(`enable_parallelism` with a ContextParallelConfig: Ulysses or Ring, in their "anything" modes, since a prompt's text
tokens need not divide by the ranks): the peer of our served Qwen-Image in benchmarks/served_pipeline.py (its
--diffusers rows), on the same pipeline directory (the same random weights), with the same request and seed.

One process per GPU (NCCL; gloo on the CPU), each loading the whole pipeline in bf16 (float32 on the CPU), the
transformer's repeated blocks compiled as our served ranks compile them (`compile_repeated_blocks`; --diffusers-eager:
not), the initial noise from a CPU generator seeded as our served pipeline draws it. Rank 0 times each image by the
wall clock from the call to the uint8 image on the host (the ranks lined up by a barrier first): a first one (it
compiles), then the images asked for, the median reported. Configurations: 1, ulyssesN or ringN.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mdtriton.harness import init_rank
from xdit_pipeline import peer_row


@dataclass(frozen=True)
class DiffusersJob:
    """What every rank of every configuration runs: images of the request on the pipeline directory."""

    pipeline_dir: Path
    device_type: str  # cuda (one GPU a rank) or cpu
    compiled: bool
    request: dict = field(hash=False)  # QwenImagePipeline's call arguments but the generator
    seed: int
    images: int
    result_dir: Path
    time_limit_s: float = 0  # a configuration's ranks are stopped after this long (0: never), its row failed


def load_pipeline(job: DiffusersJob, ulysses: int, ring: int, device: torch.device):
    """QwenImagePipeline on this rank's device, its transformer split by diffusers' own context parallelism and
    compiled as the job says."""
    from diffusers import ContextParallelConfig, QwenImagePipeline

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipeline = QwenImagePipeline.from_pretrained(job.pipeline_dir, torch_dtype=dtype, local_files_only=True).to(device)
    pipeline.set_progress_bar_config(disable=True)
    if ulysses * ring > 1:
        pipeline.transformer.enable_parallelism(config=ContextParallelConfig(
            ulysses_degree=ulysses if ulysses > 1 else None, ring_degree=ring if ring > 1 else None,
            ulysses_anything=ulysses > 1, ring_anything=ring > 1))
    if job.compiled:
        pipeline.transformer.compile_repeated_blocks(dynamic=True)
    return pipeline


def timed_image(pipeline, job: DiffusersJob) -> tuple[float, np.ndarray]:
    """Seconds from the call to the uint8 image on the host, every rank starting together, and the image."""
    dist.barrier()
    started = time.perf_counter()
    images = pipeline(**job.request, generator=torch.Generator().manual_seed(job.seed), output_type="np").images
    return time.perf_counter() - started, (images * 255).round().astype(np.uint8)


def _rank_main(rank: int, world_size: int, port: int, job: DiffusersJob, ulysses: int, ring: int) -> None:
    cuda = job.device_type == "cuda"
    device = init_rank(rank, world_size, port, cuda, group_of_one=True)

    def say(what: str) -> None:  # progress, so that a run cut short by its time limit shows where it was
        if rank == 0:
            print(f"diffusers ulysses {ulysses} x ring {ring}: {what}", flush=True)

    try:
        started = time.perf_counter()
        pipeline = load_pipeline(job, ulysses, ring, device)
        say(f"loaded in {time.perf_counter() - started:.1f} s")
        first_s, first = timed_image(pipeline, job)
        say(f"first image (compiles) in {first_s:.1f} s")
        times = []
        for _ in range(job.images):
            times.append(timed_image(pipeline, job)[0])
            say(f"image {len(times)} of {job.images} in {times[-1]:.2f} s")
        if rank == 0:
            np.save(job.result_dir / "image.npy", first)
            (job.result_dir / "times.json").write_text(json.dumps({"first_s": first_s, "times": times}))
    finally:
        dist.destroy_process_group()
    os._exit(0)


def run_diffusers(name: str, job: DiffusersJob) -> dict:
    """One configuration's row, as served_pipeline.py's rows are (the image of seed job.seed under "images"), or its
    failure (failed 1, no times)."""
    return peer_row("diffusers", name, job, _rank_main, "diffusers' enable_parallelism")
