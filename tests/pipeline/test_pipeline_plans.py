"""The named pipelines on the plans of the CPU matrix that their served tests' servers are not built with, built and
run in process on gloo ranks as a server's ranks run them (tests.pipeline.pipelines.outputs_in_process: the engine
loaded from its directory, the request checked and completed with the model's defaults), one run of ranks per size so
that each rank imports and loads once. On 2 ranks: FLUX.2 [klein] on ring, FLUX.2 [dev] (two input images) and
Qwen-Image-Edit-Plus (three) on allgather_kv, FLUX.1 Kontext both ways on allgather_kv (an input image), LTX-2 text to
video on allgather_kv and image to video on ring. On cfg 2 x ulysses 2 (4 ranks), every guiding pipeline, guided:
[klein] (guidance_scale over 1, not distilled), Edit-Plus (a negative prompt, one image), Kontext both ways
(true_cfg_scale and a negative prompt; its pipeline names no branch), Kontext on diffusers' transformer with TaylorSeer
too (the calls named for the cache are the branches split) and LTX-2 text and image to video (both branches
in one doubled batch). Each output equals diffusers' pipeline in one process within 1 uint8 level, LTX-2's sound
within diffusers' float32 tolerance. (Qwen-Image's guidance: tests/pipeline/test_guidance.py; Wan's image to video:
tests/pipeline/test_wan_i2v_pipeline.py.)"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline, LTX2ImageToVideoPipeline, LTX2Pipeline, TaylorSeerCacheConfig

from mdtriton.engine.plan import ParallelPlan
from mdtriton.testing.tiny_flux2_pipeline import save_tiny_flux2_klein_pipeline, save_tiny_flux2_pipeline
from mdtriton.testing.tiny_flux_pipeline import tiny_flux_kontext_pipeline
from mdtriton.testing.tiny_ltx2_pipeline import save_tiny_ltx2_image_to_video_pipeline, save_tiny_ltx2_pipeline
from mdtriton.testing.tiny_qwen_image_pipeline import save_tiny_qwen_image_edit_plus_pipeline
from tests.pipeline import test_flux_kontext_pipeline as kontext
from tests.pipeline import test_ltx2_pipeline as ltx2
from tests.pipeline.pipelines import max_level_difference, outputs_in_process
from tests.pipeline.test_diffusers_pipelines import KLEIN_REQUEST, reference
from tests.pipeline.test_image_pipelines import DEV_REQUEST, EDIT_REQUEST, IMAGES, edit_reference


def save_tiny_flux_kontext_pipeline(directory: Path) -> Path:
    tiny_flux_kontext_pipeline(seed=0).save_pretrained(directory)
    return directory


# Each tiny pipeline directory by kind, as the served tests save theirs.
SAVE = {"klein": save_tiny_flux2_klein_pipeline, "dev": save_tiny_flux2_pipeline,
        "edit": save_tiny_qwen_image_edit_plus_pipeline, "kontext": save_tiny_flux_kontext_pipeline,
        "ltx2": save_tiny_ltx2_pipeline, "ltx2-i2v": save_tiny_ltx2_image_to_video_pipeline}
REQUESTS = {
    "klein": KLEIN_REQUEST,
    "dev-2-images": {**DEV_REQUEST, "images": IMAGES[:2]},
    "edit-3-images": {**EDIT_REQUEST, "images": IMAGES},
    "edit-1-image": {**EDIT_REQUEST, "images": IMAGES[:1]},
    "kontext": {**kontext.REQUEST, "image": kontext.input_image()},
    "kontext-guided": {**kontext.REQUEST, "negative_prompt": ["blurry"], "true_cfg_scale": 2.0,
                       "image": kontext.input_image()},
    "kontext-guided-taylorseer": {**kontext.GUIDED_CACHED, "image": kontext.input_image(),
                                  "cache": [json.dumps(kontext.TAYLORSEER)]},
    "ltx2": ltx2.REQUEST,
    "ltx2-i2v": {**ltx2.REQUEST, "image": ltx2.IMAGE},
}
RING = ParallelPlan(cp_size=2, cp_method="ring")
ALLGATHER_KV = ParallelPlan(cp_size=2, cp_method="allgather_kv")
CFG_ULYSSES = ParallelPlan(cfg_size=2, cp_size=2, cp_method="ulysses")
# name: (architecture, directory kind, plan, request)
CASES = {
    "klein-ring": ("flux2-klein-pipeline", "klein", RING, "klein"),
    "dev-allgather_kv": ("flux2-pipeline", "dev", ALLGATHER_KV, "dev-2-images"),
    "edit-allgather_kv": ("qwen-image-edit-plus-pipeline", "edit", ALLGATHER_KV, "edit-3-images"),
    "kontext-allgather_kv": ("flux-kontext-pipeline", "kontext", ALLGATHER_KV, "kontext"),
    "kontext-generic-allgather_kv": ("flux-kontext-generic-pipeline", "kontext", ALLGATHER_KV, "kontext"),
    "ltx2-allgather_kv": ("ltx2-pipeline", "ltx2", ALLGATHER_KV, "ltx2"),
    "ltx2-i2v-ring": ("ltx2-image-to-video-pipeline", "ltx2-i2v", RING, "ltx2-i2v"),
    "klein-cfg2xulysses2": ("flux2-klein-pipeline", "klein", CFG_ULYSSES, "klein"),
    "edit-cfg2xulysses2": ("qwen-image-edit-plus-pipeline", "edit", CFG_ULYSSES, "edit-1-image"),
    "kontext-cfg2xulysses2": ("flux-kontext-pipeline", "kontext", CFG_ULYSSES, "kontext-guided"),
    "kontext-generic-cfg2xulysses2": ("flux-kontext-generic-pipeline", "kontext", CFG_ULYSSES, "kontext-guided"),
    # The calls it names for a step cache ("cond", then "uncond") are the branches the guidance groups split.
    "kontext-generic-taylorseer-cfg2xulysses2": ("flux-kontext-generic-pipeline", "kontext", CFG_ULYSSES,
                                                 "kontext-guided-taylorseer"),
    "ltx2-cfg2xulysses2": ("ltx2-pipeline", "ltx2", CFG_ULYSSES, "ltx2"),
    "ltx2-i2v-cfg2xulysses2": ("ltx2-image-to-video-pipeline", "ltx2-i2v", CFG_ULYSSES, "ltx2-i2v"),
}


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {kind: save(root / kind) for kind, save in SAVE.items()}


@pytest.fixture(scope="module")
def outputs(directories, tmp_path_factory) -> dict[str, list[dict]]:
    """Each case's outputs, rank by rank: the cases of 2 ranks in one run of 2 gloo ranks, those of 4 in one of 4."""
    root = tmp_path_factory.mktemp("repositories")
    results = {}
    for world_size in (2, 4):
        builds = {name: (architecture, directories[kind], plan, REQUESTS[request])
                  for name, (architecture, kind, plan, request) in CASES.items() if plan.world_size == world_size}
        ranks = outputs_in_process(root / f"world{world_size}", builds)
        results.update({name: [rank_outputs[name] for rank_outputs in ranks] for name in builds})
    return results


@functools.cache
def expected(kind: str, pipeline_dir: Path, request_name: str) -> dict[str, np.ndarray]:
    """diffusers' outputs in one process for a request to a directory of that kind."""
    request = REQUESTS[request_name]
    if kind in ("klein", "dev"):
        return {"image": reference(pipeline_dir, request, Flux2KleinPipeline if kind == "klein" else Flux2Pipeline)}
    if kind == "edit":
        return {"image": edit_reference(pipeline_dir, request)}
    if kind == "kontext":
        cache = TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1) if "cache" in request else None
        return {"image": kontext.reference(pipeline_dir, {key: value for key, value in request.items()
                                                          if key not in ("image", "cache")}, request["image"], cache)}
    frames, audio = ltx2.reference(LTX2Pipeline if kind == "ltx2" else LTX2ImageToVideoPipeline, pipeline_dir, request)
    return {"video": frames, "audio": audio}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", CASES)
def test_each_plan_equals_diffusers_in_one_process(directories, outputs, name):
    _, kind, _, request = CASES[name]
    for rank, answer in enumerate(outputs[name]):
        for output, want in expected(kind, directories[kind], request).items():
            if output == "audio":
                torch.testing.assert_close(torch.from_numpy(answer[output]), torch.from_numpy(want),
                                           **ltx2.AUDIO_TOLERANCE)
            else:
                assert max_level_difference(answer[output], want) <= 1, f"{output}, rank {rank}"
