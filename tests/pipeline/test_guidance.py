"""Guidance parallelism (mdtriton.pipeline.guidance, and our FLUX engine's for Kontext) inside a pipeline, with the
context-parallel split inside each guidance group, on 4 gloo ranks (cfg 2 x ulysses 2): tiny Qwen-Image, each rank's
image equal to the pipeline in one process, guided (a negative prompt: each rank runs one branch, one forward a step)
and unguided (none: every rank runs the step's one call); and every other guiding pipeline, built and loaded as served,
each rank's outputs equal to diffusers' in one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, LTX2ImageToVideoPipeline, LTX2Pipeline

from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.qwen_image import QWEN_IMAGE
from mdtriton.testing.tiny_flux2_pipeline import save_tiny_flux2_klein_pipeline
from mdtriton.testing.tiny_flux_pipeline import tiny_flux_kontext_pipeline
from mdtriton.testing.tiny_ltx2_pipeline import save_tiny_ltx2_image_to_video_pipeline, save_tiny_ltx2_pipeline
from mdtriton.testing.tiny_qwen_image_pipeline import save_tiny_qwen_image_edit_plus_pipeline, tiny_qwen_image_pipeline
from tests.distributed import run_ranks
from tests.pipeline.pipelines import max_level_difference, outputs_in_process
from tests.pipeline.test_diffusers_pipelines import KLEIN_REQUEST as KLEIN
from tests.pipeline.test_diffusers_pipelines import reference
from tests.pipeline.test_flux_kontext_pipeline import REQUEST as KONTEXT
from tests.pipeline.test_flux_kontext_pipeline import input_image as kontext_image
from tests.pipeline.test_flux_kontext_pipeline import reference as kontext_reference
from tests.pipeline.test_image_pipelines import EDIT_REQUEST as EDIT
from tests.pipeline.test_image_pipelines import IMAGES as EDIT_IMAGES
from tests.pipeline.test_image_pipelines import edit_reference
from tests.pipeline.test_ltx2_pipeline import AUDIO_TOLERANCE
from tests.pipeline.test_ltx2_pipeline import IMAGE as LTX2_IMAGE
from tests.pipeline.test_ltx2_pipeline import REQUEST as LTX2
from tests.pipeline.test_ltx2_pipeline import reference as ltx2_reference

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


def save_tiny_flux_kontext_pipeline(directory: Path) -> Path:
    tiny_flux_kontext_pipeline(seed=0).save_pretrained(directory)
    return directory


# Every other guiding pipeline, built on cfg 2 x ulysses 2 and run on 4 gloo ranks as a server's ranks run it
# (tests.pipeline.pipelines.outputs_in_process: the request checked and completed with its defaults), each guided
# request's outputs equal to diffusers' pipeline in one process: FLUX.2 [klein] (guidance_scale over 1, not distilled),
# Qwen-Image-Edit-Plus (a negative prompt), FLUX.1 Kontext both ways (true_cfg_scale and a negative prompt; its
# pipeline names no branch) and LTX-2 text and image to video (both branches in one doubled batch).
KONTEXT_REQUEST = {**KONTEXT, "negative_prompt": ["blurry"], "true_cfg_scale": 2.0, "image": kontext_image()}
LTX2_I2V_REQUEST = {**LTX2, "image": LTX2_IMAGE}
GUIDED_PIPELINES = {
    "klein": ("flux2-klein-pipeline", save_tiny_flux2_klein_pipeline, KLEIN),
    "edit-plus": ("qwen-image-edit-plus-pipeline", save_tiny_qwen_image_edit_plus_pipeline,
                  {**EDIT, "images": EDIT_IMAGES[:1]}),
    "kontext": ("flux-kontext-pipeline", save_tiny_flux_kontext_pipeline, KONTEXT_REQUEST),
    "kontext-generic": ("flux-kontext-generic-pipeline", save_tiny_flux_kontext_pipeline, KONTEXT_REQUEST),
    "ltx2": ("ltx2-pipeline", save_tiny_ltx2_pipeline, LTX2),
    "ltx2-i2v": ("ltx2-image-to-video-pipeline", save_tiny_ltx2_image_to_video_pipeline, LTX2_I2V_REQUEST),
}


@pytest.fixture(scope="module")
def guided_pipelines(tmp_path_factory):
    """Each guiding pipeline's directory, and its outputs on the 4 ranks of cfg 2 x ulysses 2, rank by rank."""
    root = tmp_path_factory.mktemp("guided")
    plan = ParallelPlan(cfg_size=2, cp_size=2, cp_method="ulysses")
    directories = {name: save(root / name) for name, (_, save, _) in GUIDED_PIPELINES.items()}
    builds = {name: (architecture, directories[name], plan, request)
              for name, (architecture, _, request) in GUIDED_PIPELINES.items()}
    return directories, outputs_in_process(root / "repository", builds)


def guided_reference(name: str, pipeline_dir: Path) -> dict[str, np.ndarray]:
    """diffusers' outputs in one process for GUIDED_PIPELINES[name]'s request."""
    request = GUIDED_PIPELINES[name][2]
    if name == "klein":
        return {"image": reference(pipeline_dir, request, Flux2KleinPipeline)}
    if name == "edit-plus":
        return {"image": edit_reference(pipeline_dir, request)}
    if name.startswith("kontext"):
        return {"image": kontext_reference(pipeline_dir, {k: v for k, v in request.items() if k != "image"},
                                           request["image"])}
    pipeline_class = LTX2Pipeline if name == "ltx2" else LTX2ImageToVideoPipeline
    frames, audio = ltx2_reference(pipeline_class, pipeline_dir, request)
    return {"video": frames, "audio": audio}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", GUIDED_PIPELINES)
def test_every_guiding_pipeline_on_cfg2_x_ulysses2_equals_diffusers(guided_pipelines, name):
    directories, results = guided_pipelines
    expected = guided_reference(name, directories[name])
    for rank, outputs in enumerate(results):
        for output, want in expected.items():
            if output == "audio":
                torch.testing.assert_close(torch.from_numpy(outputs[name][output]), torch.from_numpy(want),
                                           **AUDIO_TOLERANCE)
            else:
                assert max_level_difference(outputs[name][output], want) <= 1, f"{output}, rank {rank}"
