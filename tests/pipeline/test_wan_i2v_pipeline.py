"""Wan image to video (wan-i2v-pipeline, diffusers' WanImageToVideoPipeline): Wan 2.1 I2V (its image encoder's tokens
beside the text), Wan 2.2 I2V A14B (two experts; a first and a last frame) and Wan 2.2 TI2V given an image (a timestep
per token). Each on 2 CPU ranks (gloo) with ulysses, ring, tp and on cfg 2 x ulysses 2 (4 ranks), Wan 2.1 I2V also
with cfg 2, in one process and served by a real tritonserver: every video must equal diffusers' pipeline with the same
components, image and seed within one uint8 level. Bad requests are refused naming the input (served:
INVALID_ARGUMENT while a good request runs).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.cli import main
from mdtriton.client.grpc_client import ClientError
from mdtriton.client.pipeline import generate_video
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineLimits, Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.request_check import RequestError
from mdtriton.families.wan.image_pipeline import WanImageToVideoPipelinePart
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.serving import load_engine
from mdtriton.testing.tiny_wan_pipeline import (I2V_LAYOUTS, reference_i2v_video, sample_image,
                                                save_tiny_wan_i2v_pipeline)
from tests.conftest import start_server
from tests.distributed import run_ranks
from tests.pipeline.pipelines import max_level_difference

pytest.importorskip("ftfy", reason="diffusers' WanImageToVideoPipeline cleans prompts with ftfy")

# 9 frames of 32x48: 3 latent frames x 2 x 3 patches = 18 tokens. The image is of another size (the pipeline resizes
# it); Wan 2.2 I2V A14B also gets a last frame.
GOOD = dict(height=32, width=48, num_frames=9, num_inference_steps=3, guidance_scale=5.0, seed=4)
IMAGE, LAST_IMAGE = sample_image(40, 56, seed=1), sample_image(32, 48, seed=2)
PLANS = {"ulysses2": ParallelPlan(cp_size=2, cp_method="ulysses"), "ring2": ParallelPlan(cp_size=2, cp_method="ring"),
         "tp2": ParallelPlan(tp_size=2), "cfg2": ParallelPlan(cfg_size=2)}
LIMITS = EngineLimits(max_batch_size=2, max_tokens=48)
SERVED = "wan21-i2v_ulysses2"


def options(layout: str) -> dict:
    """The request's inputs beside GOOD's for a layout: a last frame and the second expert's guidance for Wan 2.2 I2V
    A14B."""
    return {"last_image": LAST_IMAGE, "guidance_scale_2": 3.0} if layout == "wan2.2-i2v-a14b" else {}


def request(layout: str) -> dict[str, torch.Tensor]:
    """"a red cat" with IMAGE (and options(layout)), as the server hands a request to the pipeline engine."""
    types = {"height": torch.int32, "width": torch.int32, "num_frames": torch.int32,
             "num_inference_steps": torch.int32, "guidance_scale": torch.float32, "seed": torch.int64,
             "guidance_scale_2": torch.float32}
    values = {**GOOD, **options(layout)}
    inputs = {"prompt": torch.from_numpy(prompt_tensor(["a red cat"])), "image": torch.from_numpy(IMAGE),
              **{name: torch.tensor([values[name]], dtype=dtype) for name, dtype in types.items() if name in values}}
    if "last_image" in values:
        inputs["last_image"] = torch.from_numpy(values["last_image"])
    return inputs


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_i2v")
    return {layout: save_tiny_wan_i2v_pipeline(root / layout, layout, seed=i) for i, layout in enumerate(I2V_LAYOUTS)}


@pytest.fixture(scope="module")
def expected(pipelines):
    """diffusers' video for request(layout) of each layout."""
    return {layout: reference_i2v_video(pipelines[layout], ["a red cat"], IMAGE, GOOD["height"], GOOD["width"],
                                        GOOD["num_frames"], GOOD["num_inference_steps"], GOOD["guidance_scale"],
                                        GOOD["seed"], **options(layout))
            for layout in I2V_LAYOUTS}


@pytest.fixture(scope="module")
def engines(pipelines, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """An engine directory per layout and plan of 2 ranks (guidance parallelism, whose split is the same for every
    layout, with Wan 2.1 I2V only)."""
    root = tmp_path_factory.mktemp("wan_i2v_engines")
    return {(layout, plan): build_model_version(root, f"{layout}_{plan}",
                                                BuildRequest("wan-i2v-pipeline", None, PLANS[plan], "FP32", "cpu",
                                                             weights_path=pipelines[layout], progress=False,
                                                             limits=LIMITS)) / ENGINE_DIR
            for layout in I2V_LAYOUTS for plan in PLANS if plan != "cfg2" or layout == "wan2.1-i2v"}


def run_pipelines(rank: int, world_size: int, engine_dirs: dict[str, str],
                  requests: dict[str, dict]) -> dict[str, np.ndarray]:
    """On one rank of a gloo world: each pipeline engine loaded, and its request's video."""
    videos = {}
    for name, engine_dir in engine_dirs.items():
        manifest = Manifest.read(Path(engine_dir))
        comm = Communicator(manifest.plan, rank, torch.device("cpu"))
        comm.join_groups()
        videos[name] = load_engine(Path(engine_dir), manifest, comm).forward(requests[name])["video"].numpy()
    return videos


def test_one_rank_video_equals_diffusers(pipelines, expected, tmp_path):
    """Wan 2.1 I2V in one process: the engine is the pipeline's transformer, called as diffusers calls it."""
    version_dir = build_model_version(tmp_path, "wan", BuildRequest(
        "wan-i2v-pipeline", None, ParallelPlan(), "FP32", "cpu", weights_path=pipelines["wan2.1-i2v"], progress=False))
    engine_dir = version_dir / ENGINE_DIR
    video = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single()).forward(
        request("wan2.1-i2v"))["video"].numpy()
    assert max_level_difference(video, expected["wan2.1-i2v"]) <= 1
    assert video.std() > 10  # a real (random) video, not a blank one


@pytest.mark.timeout(600)
def test_every_layout_and_plan_of_2_ranks_equals_diffusers(engines, expected):
    names = {f"{layout}_{plan}": str(engine_dir) for (layout, plan), engine_dir in engines.items()}
    requests = {f"{layout}_{plan}": request(layout) for layout, plan in engines}
    for rank, videos in enumerate(run_ranks(2, run_pipelines, names, requests, timeout=540)):
        for (layout, plan) in engines:
            difference = max_level_difference(videos[f"{layout}_{plan}"], expected[layout])
            assert difference <= 1, f"{layout} on {plan}, rank {rank}: {difference} levels"


@pytest.mark.timeout(600)
def test_every_layout_on_cfg2_x_ulysses2_equals_diffusers(pipelines, expected, tmp_path):
    """Guidance parallelism over context parallelism: 4 ranks, each guidance group's 2 ranks splitting the video (Wan
    2.2 I2V A14B: both experts, each guided)."""
    plan = ParallelPlan(cfg_size=2, cp_size=2, cp_method="ulysses")
    engine_dirs = {layout: str(build_model_version(tmp_path, layout, BuildRequest(
        "wan-i2v-pipeline", None, plan, "FP32", "cpu", weights_path=pipelines[layout], progress=False,
        limits=LIMITS)) / ENGINE_DIR) for layout in I2V_LAYOUTS}
    requests = {layout: request(layout) for layout in I2V_LAYOUTS}
    for rank, videos in enumerate(run_ranks(4, run_pipelines, engine_dirs, requests, timeout=540)):
        for layout in I2V_LAYOUTS:
            assert max_level_difference(videos[layout], expected[layout]) <= 1, f"{layout}, rank {rank}"


# What each layout refuses beside wan-pipeline's checks (every layout's model, 2 ranks of ulysses).
REFUSED = [
    ("wan2.1-i2v", {"image": IMAGE[:2]}, "image is 56x2: its aspect differs from the video's (48x32)"),
    ("wan2.1-i2v", {"image": np.zeros((5000, 5000, 3), np.uint8)}, "image has shape [5000, 5000, 3]; send UINT8"),
    ("wan2.1-i2v", {"last_image": LAST_IMAGE}, "last_image: this model's image encoder reads one image"),
    ("wan2.1-i2v", {"max_sequence_length": 64}, "max_sequence_length: Wan 2.1 image-to-video takes the whole 512"),
    ("wan2.2-ti2v", {"last_image": LAST_IMAGE}, "last_image: Wan 2.2 TI2V conditions only the first frame"),
    ("wan2.2-ti2v", {"num_frames": 13, "height": 64, "width": 64}, "64x64 x 13 frames is 64 tokens, over this "
                                                                    "engine's maximum of 48"),
    ("wan2.2-i2v-a14b", {"last_image": LAST_IMAGE[:1]}, "last_image is 48x1: its aspect differs"),
    ("wan2.2-i2v-a14b", {"num_frames": 7}, "num_frames 7 is not 4k+1; send 5 or 9"),
]


@pytest.mark.parametrize("layout, change, message", REFUSED, ids=[f"{layout}-{next(iter(change))}"
                                                                  for layout, change, _ in REFUSED])
def test_requests_a_layout_cannot_take_are_refused_naming_the_input(engines, layout, change, message):
    inputs = {**request(layout), **{name: torch.tensor([value], dtype=torch.int32) if isinstance(value, int)
                                    else torch.from_numpy(value) for name, value in change.items()}}
    with pytest.raises(RequestError, match=re.escape(message)):
        WanImageToVideoPipelinePart().check_inputs(Manifest.read(engines[(layout, "ulysses2")]), inputs)


@pytest.fixture(scope="module")
def served(pipelines, tmp_path_factory):
    repository = tmp_path_factory.mktemp("wan_i2v_repository")
    build_model_version(repository, SERVED, BuildRequest(
        "wan-i2v-pipeline", None, PLANS["ulysses2"], "FP32", "cpu", weights_path=pipelines["wan2.1-i2v"],
        progress=False, limits=LIMITS))
    server = start_server(repository, repository.parent / "wan_i2v_server.log")
    yield server
    server.stop()


BAD = [({"image": IMAGE[:, :, :2]}, "unexpected shape for input 'image'"),
       ({"image": IMAGE[:2]}, "image is 56x2: its aspect differs from the video's (48x32)"),
       ({"last_image": LAST_IMAGE}, "last_image: this model's image encoder reads one image"),
       ({"height": 64, "width": 64, "num_frames": 13}, "64x64 x 13 frames is 64 tokens, over this engine's maximum")]


@pytest.mark.timeout(300)
def test_served_bad_inputs_are_refused_while_a_good_request_runs_and_it_equals_diffusers(served, expected):
    good: dict = {}
    running = threading.Thread(target=lambda: good.update(video=generate_video(
        served.grpc_address, SERVED, "a red cat", **GOOD, image=IMAGE, timeout=240)))
    running.start()
    for change, message in BAD:
        with pytest.raises(ClientError) as caught:
            generate_video(served.grpc_address, SERVED, "a red cat", timeout=120, **{**GOOD, "image": IMAGE, **change})
        assert "INVALID_ARGUMENT" in str(caught.value) and message in str(caught.value), str(caught.value)
    running.join()
    assert max_level_difference(good["video"], expected["wan2.1-i2v"]) <= 1


@pytest.mark.timeout(300)
def test_generate_command_sends_the_image_and_the_last_image(served, expected, tmp_path, capsys):
    from PIL import Image

    Image.fromarray(IMAGE).save(tmp_path / "first.png")
    Image.fromarray(LAST_IMAGE).save(tmp_path / "last.png")
    command = ["generate", SERVED, "a red cat", "--url", served.grpc_address, "--height", "32", "--width", "48",
               "--num-frames", "9", "--steps", "3", "--seed", "4", "--image", str(tmp_path / "first.png")]
    assert main(command + ["-o", str(tmp_path / "clip.npy")]) == 0
    assert max_level_difference(np.load(tmp_path / "clip.npy"), expected["wan2.1-i2v"][0]) <= 1
    assert main(command + ["--last-image", str(tmp_path / "last.png"), "-o", str(tmp_path / "clip.npy")]) == 1
    assert "last_image: this model's image encoder reads one image" in capsys.readouterr().err
