"""Wan image to video (wan-i2v-pipeline, diffusers' WanImageToVideoPipeline): Wan 2.1 I2V (its image encoder's tokens
beside the text), Wan 2.2 I2V A14B (two experts; a first and a last frame) and Wan 2.2 TI2V given an image (a timestep
per token), in one process and served by a real tritonserver on 2 CPU ranks (gloo) with ulysses, ring and tp. Every
video must equal diffusers' pipeline with the same components, image and seed within one uint8 level; bad requests
get INVALID_ARGUMENT naming the input while a good request runs, and it still equals diffusers'.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.client.grpc_client import ClientError
from mdtriton.client.pipeline import generate_video
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineLimits, Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.serving import load_engine
from mdtriton.testing.tiny_wan_pipeline import I2V_LAYOUTS, reference_i2v_video, save_tiny_wan_i2v_pipeline, sample_image
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference

pytest.importorskip("ftfy", reason="diffusers' WanImageToVideoPipeline cleans prompts with ftfy")

# 9 frames of 32x48: 3 latent frames x 2 x 3 patches = 18 tokens. The image is of another size (the pipeline resizes
# it); Wan 2.2 I2V A14B also gets a last frame.
GOOD = dict(height=32, width=48, num_frames=9, num_inference_steps=3, guidance_scale=5.0, seed=4)
IMAGE, LAST_IMAGE = sample_image(40, 56, seed=1), sample_image(32, 48, seed=2)
PLANS = {"ulysses2": ParallelPlan(cp_size=2, cp_method="ulysses"), "ring2": ParallelPlan(cp_size=2, cp_method="ring"),
         "tp2": ParallelPlan(tp_size=2)}
# Each plan once, each layout at least once (tests/engine/test_wan.py checks the image tokens and a timestep per token
# on every plan of 2 ranks; 8 rank workers is what one server of these starts in time on 2 busy cores).
MODELS = {"wan21-i2v_ulysses2": ("wan2.1-i2v", "ulysses2"), "wan21-i2v_tp2": ("wan2.1-i2v", "tp2"),
          "wan22-i2v-a14b_ring2": ("wan2.2-i2v-a14b", "ring2"), "wan22-ti2v_ulysses2": ("wan2.2-ti2v", "ulysses2")}
LIMITS = EngineLimits(max_batch_size=2, max_tokens=48)


def options(layout: str) -> dict:
    """The request's inputs beside GOOD's for a layout: a last frame and the second expert's guidance for Wan 2.2 I2V
    A14B."""
    return {"last_image": LAST_IMAGE, "guidance_scale_2": 3.0} if layout == "wan2.2-i2v-a14b" else {}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_i2v")
    return {layout: save_tiny_wan_i2v_pipeline(root / layout, layout, seed=i) for i, layout in enumerate(I2V_LAYOUTS)}


@pytest.fixture(scope="module")
def expected(pipelines):
    """diffusers' video for "a red cat" of each layout (every served model's answer must equal it)."""
    return {layout: reference_i2v_video(pipelines[layout], ["a red cat"], IMAGE, GOOD["height"], GOOD["width"],
                                        GOOD["num_frames"], GOOD["num_inference_steps"], GOOD["guidance_scale"],
                                        GOOD["seed"], **options(layout))
            for layout in I2V_LAYOUTS}


@pytest.fixture(scope="module")
def served(pipelines, tmp_path_factory):
    repository = tmp_path_factory.mktemp("wan_i2v_repository")
    for name, (layout, plan) in MODELS.items():
        build_model_version(repository, name, "wan-i2v-pipeline", None, PLANS[plan], "FP32", "cpu",
                            weights_path=pipelines[layout], progress=False, limits=LIMITS)
    server = start_server(repository, repository.parent / "wan_i2v_server.log")
    yield server
    server.stop()


def test_one_rank_video_equals_diffusers(pipelines, expected, tmp_path):
    """Wan 2.1 I2V in one process: the engine is the pipeline's transformer, called as diffusers calls it."""
    version_dir = build_model_version(tmp_path, "wan", "wan-i2v-pipeline", None, ParallelPlan(), "FP32", "cpu",
                                      weights_path=pipelines["wan2.1-i2v"], progress=False)
    engine_dir = version_dir / ENGINE_DIR
    engine = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single())
    video = engine.forward(served_request(GOOD, "a red cat", IMAGE))["video"].numpy()
    assert max_level_difference(video, expected["wan2.1-i2v"]) <= 1
    assert video.std() > 10  # a real (random) video, not a blank one


def served_request(values: dict, prompt: str, image: np.ndarray) -> dict[str, torch.Tensor]:
    """A request's tensors as the server hands them to the pipeline engine."""
    types = {"height": torch.int32, "width": torch.int32, "num_frames": torch.int32,
             "num_inference_steps": torch.int32, "guidance_scale": torch.float32, "seed": torch.int64}
    return {"prompt": torch.from_numpy(prompt_tensor([prompt])), "image": torch.from_numpy(image),
            **{name: torch.tensor([values[name]], dtype=dtype) for name, dtype in types.items()}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_served_video_equals_diffusers_on_2_ranks(served, expected, model):
    layout = MODELS[model][0]
    video = generate_video(served.grpc_address, model, "a red cat", **GOOD, image=IMAGE, **options(layout),
                           timeout=240)
    assert max_level_difference(video, expected[layout]) <= 1


BAD = [
    ("wan21-i2v_ulysses2", {"image": IMAGE[:, :, :2]}, "unexpected shape for input 'image'"),
    ("wan21-i2v_ulysses2", {"image": IMAGE[:2]}, "image is 56x2: its aspect differs from the video's (48x32)"),
    ("wan21-i2v_ulysses2", {"last_image": LAST_IMAGE}, "last_image: this model's image encoder reads one image"),
    ("wan21-i2v_ulysses2", {"max_sequence_length": 64}, "max_sequence_length: Wan 2.1 image-to-video takes the whole "
                                                       "512 text tokens"),
    ("wan22-ti2v_ulysses2", {"last_image": LAST_IMAGE}, "last_image: Wan 2.2 TI2V conditions only the first frame"),
    ("wan22-ti2v_ulysses2", {"width": 48 + 16}, "width 64 is not a positive multiple of 32"),
    ("wan22-i2v-a14b_ring2", {"last_image": LAST_IMAGE[:1]}, "last_image is 48x1: its aspect differs"),
    ("wan22-i2v-a14b_ring2", {"num_frames": 7}, "num_frames 7 is not 4k+1; send 5 or 9"),
    ("wan22-i2v-a14b_ring2", {"height": 64, "width": 64, "num_frames": 13}, "64x64 x 13 frames is 64 tokens, over "
                                                                            "this engine's maximum of 48"),
]


@pytest.mark.timeout(300)
def test_bad_inputs_are_refused_naming_the_input_while_a_good_request_runs(served, expected):
    good: dict = {}
    running = threading.Thread(target=lambda: good.update(video=generate_video(
        served.grpc_address, "wan21-i2v_ulysses2", "a red cat", **GOOD, image=IMAGE, timeout=240)))
    running.start()
    for model, change, message in BAD:
        arguments = {**GOOD, "image": IMAGE, **change}
        with pytest.raises(ClientError) as caught:
            generate_video(served.grpc_address, model, "a red cat", timeout=120, **arguments)
        assert "INVALID_ARGUMENT" in str(caught.value) and message in str(caught.value), (model, str(caught.value))
    running.join()
    assert max_level_difference(good["video"], expected["wan2.1-i2v"]) <= 1
