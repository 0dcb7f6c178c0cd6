"""Guidance parallelism for diffusers' own transformer (mdtriton.pipeline.guidance) inside a pipeline, with the
context-parallel split inside each guidance group: tiny Qwen-Image on 4 gloo ranks (cfg 2 x ulysses 2), each rank's
image equal to the pipeline in one process, guided (a negative prompt: each rank runs one branch, one forward a step)
and unguided (none: every rank runs the step's one call)."""

from __future__ import annotations

import numpy as np
import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.qwen_image import QWEN_IMAGE
from mdtriton.testing.tiny_qwen_image_pipeline import tiny_qwen_image_pipeline
from tests.distributed import run_ranks

GUIDED = dict(prompt=["a red cat on a blue mat"], negative_prompt=["blurry"], height=64, width=48,
              num_inference_steps=2, true_cfg_scale=4.0)
UNGUIDED = {**GUIDED, "negative_prompt": None}


def images(pipeline, requests: list[dict], before_call=None) -> list[np.ndarray]:
    """Each request's image as uint8, seeded alike."""
    out = []
    for request in requests:
        if before_call is not None:
            before_call(request)
        with torch.no_grad():
            image = pipeline(**request, generator=torch.Generator().manual_seed(7), output_type="np").images
        out.append((image * 255).round().astype(np.uint8))
    return out


def on_ranks(rank: int, world_size: int, requests: list[dict]) -> list[tuple[np.ndarray, int]]:
    """Each request's image on this rank and the forwards its transformer ran for it."""
    comm = Communicator(ParallelPlan(cfg_size=2, cp_size=2, cp_method="ulysses"), rank, torch.device("cpu"))
    comm.join_groups()
    pipeline = tiny_qwen_image_pipeline()
    pipeline.set_progress_bar_config(disable=True)
    QWEN_IMAGE.prepare(pipeline, comm, compiled=False)
    forwards = []
    pipeline.transformer.proj_out.register_forward_pre_hook(lambda module, args: forwards.append(1))
    out = []
    for request in requests:
        before = len(forwards)
        out.append((images(pipeline, [request], lambda call: QWEN_IMAGE.before_call(pipeline, call))[0],
                    len(forwards) - before))
    return out


def test_guidance_groups_with_ulysses_in_each_equal_one_process():
    requests = [GUIDED, UNGUIDED]
    pipeline = tiny_qwen_image_pipeline()
    pipeline.set_progress_bar_config(disable=True)
    expected = images(pipeline, requests)
    for rank, results in enumerate(run_ranks(4, on_ranks, requests)):
        for (image, forwards), want in zip(results, expected):
            assert np.abs(image.astype(np.int16) - want.astype(np.int16)).max() <= 1, f"rank {rank}"
            assert forwards == GUIDED["num_inference_steps"], f"rank {rank} ran {forwards} forwards"
