"""The Cosmos 3 pipeline: text to video, text to image and image to video in one process, and served by a real
tritonserver on 2 CPU ranks (tp 2, ulysses 2, guidance parallelism) over gRPC, unary and streamed. Every video must
equal diffusers' Cosmos3OmniPipeline with the same components within one uint8 level; bad requests (and requests for
sound, actions, video to video) get INVALID_ARGUMENT saying what to send, and the server keeps serving; `mdtriton
generate` writes an image of one frame and an image-to-video clip.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.cli import main
from mdtriton.client.grpc_client import ClientError
from mdtriton.client.pipeline import ask, generate_video, infer_inputs, texts
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineLimits, Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.job_control import JobControl, controlled_by
from mdtriton.serving import load_engine
from mdtriton.pipeline.prompts import prompt_tensor
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference
from mdtriton.testing.tiny_cosmos3_pipeline import reference_video, save_tiny_cosmos3_pipeline

# 9 frames of 32x48: 3 latent frames of 1 x 2 patches (the latent's 3 columns padded to 4): 6 video tokens after the
# text (a few hundred: one per byte of the chat template, system prompt, prompt and metadata sentences).
GOOD = dict(height=32, width=48, num_frames=9, num_inference_steps=3, guidance_scale=6.0, seed=4)
MODELS = {  # served: name -> plan
    "cosmos_tp2": ParallelPlan(tp_size=2),
    "cosmos_ulysses2": ParallelPlan(cp_size=2, cp_method="ulysses"),
    "cosmos_cfg2": ParallelPlan(cfg_size=2),
}
UNARY = "cosmos_tp2"  # answers each request once (the default); the others stream their progress (--stream)
LIMITS = EngineLimits(max_batch_size=1, max_tokens=300)
IMAGE = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)  # cropped and resized to 32x48


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    return save_tiny_cosmos3_pipeline(tmp_path_factory.mktemp("cosmos3") / "pipeline")


@pytest.fixture(scope="module")
def served(pipeline_dir, tmp_path_factory):
    repository = tmp_path_factory.mktemp("cosmos3_repository")
    for name, plan in MODELS.items():
        build_model_version(repository, name, BuildRequest(
            "cosmos3-pipeline", None, plan, "FP32", "cpu", weights_path=pipeline_dir, progress=False, limits=LIMITS,
            stream=name != UNARY))
    server = start_server(repository, repository.parent / "cosmos3_server.log")
    yield server
    server.stop()


def request(prompt: str, image: np.ndarray | None = None, fps: float = 24.0, **values) -> dict[str, torch.Tensor]:
    """A complete request, as a rank gets it (the receiving stub adds the defaults of what a client leaves out)."""
    types = {"height": torch.int32, "width": torch.int32, "num_frames": torch.int32,
             "num_inference_steps": torch.int32, "guidance_scale": torch.float32, "seed": torch.int64}
    inputs = {"prompt": torch.from_numpy(prompt_tensor([prompt])), "fps": torch.tensor([fps]),
              **{name: torch.tensor([values[name]], dtype=dtype) for name, dtype in types.items()}}
    return inputs if image is None else {**inputs, "image": torch.from_numpy(image)}


def test_one_rank_makes_diffusers_videos_images_and_image_to_video(pipeline_dir, tmp_path):
    version_dir = build_model_version(tmp_path, "cosmos3", BuildRequest(
        "cosmos3-pipeline", None, ParallelPlan(), "FP32", "cpu", weights_path=pipeline_dir, progress=False))
    engine_dir = version_dir / ENGINE_DIR
    engine = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single())
    for frames, image in ((9, None), (1, None), (9, IMAGE)):
        reported = []
        values = {**GOOD, "num_frames": frames}
        with controlled_by(JobControl(on_progress=lambda done, total: reported.append((done, total)))):
            video = engine.forward(request("a red cat", image, **values))["video"].numpy()
        expected = reference_video(pipeline_dir, "a red cat", 32, 48, frames, GOOD["num_inference_steps"],
                                   GOOD["guidance_scale"], GOOD["seed"], **({} if image is None else {"image": image}))
        assert video.shape == (1, frames, 32, 48, 3)
        assert max_level_difference(video, expected) <= 1, (frames, image is not None)
        assert video.std() > 10  # a real (random) video, not a blank one
        assert reported == [(1, 3), (2, 3), (3, 3)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, options", [
    ("cosmos_tp2", {"negative_prompt": "blurry", "fps": 30.0}),
    ("cosmos_ulysses2", {"image": IMAGE}),
    ("cosmos_cfg2", {"negative_prompt": "dark"}),
    ("cosmos_cfg2", {"guidance_scale": 1.0}),  # no unconditional call: both guidance groups run the one branch
    ("cosmos_cfg2", {"num_frames": 1}),
])
def test_served_video_equals_diffusers_on_2_ranks(served, pipeline_dir, model, options):
    values = {**GOOD, **options}
    steps = []
    video = generate_video(served.grpc_address, model, "a red cat", **values, timeout=240,
                           on_step=lambda done, total: steps.append((done, total)))
    expected = reference_video(pipeline_dir, "a red cat", values.pop("height"), values.pop("width"),
                               values.pop("num_frames"), values.pop("num_inference_steps"),
                               values.pop("guidance_scale"), values.pop("seed"), **values)
    assert max_level_difference(video, expected) <= 1
    assert steps == ([] if model == UNARY else [(1, 3), (2, 3), (3, 3)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["cosmos_ulysses2", "cosmos_cfg2"])
def test_first_block_cache_equals_diffusers_with_context_and_guidance_parallelism(served, pipeline_dir, model):
    """Each guidance branch keeps a cache state of its own, as diffusers' cache contexts do; under guidance
    parallelism each guidance group runs one branch (after the first step), so each decides for its own."""
    arguments = {**GOOD, "num_inference_steps": 6}
    counts = []
    video = generate_video(served.grpc_address, model, "a red cat", **arguments, timeout=240,
                           cache={"method": "first_block", "threshold": 0.2}, on_full_steps=counts.append)
    expected = reference_video(pipeline_dir, "a red cat", 32, 48, 9, 6, GOOD["guidance_scale"], GOOD["seed"],
                               cache_threshold=0.2)
    uncached = reference_video(pipeline_dir, "a red cat", 32, 48, 9, 6, GOOD["guidance_scale"], GOOD["seed"])
    assert max_level_difference(video, expected) <= 1 < max_level_difference(video, uncached)
    assert 1 <= counts[0] < 6  # the conditional branch's calls that ran every layer


# At most 300 tokens: 32x48 x 9 frames is 6 video tokens and a short prompt's text at most 256 + its bytes.
BAD = [
    ({"num_frames": 8}, "num_frames 8 is not 4k+1; send 5 or 9"),
    ({"height": 40}, "height 40 is not a positive multiple of 16; send a height of 32 or 48"),
    ({"height": 256, "width": 256}, "256x256 x 9 frames is 192 video tokens, and the prompt up to 261 text tokens, "
                                    "over this engine's maximum of 300"),
    ({"num_frames": 1, "image": IMAGE}, "with num_frames 1 (an image) leave image out"),
    ({"image": IMAGE[:, :, :2]}, "image"),  # Triton refuses the shape: [40, 50, 2] is not [-1, -1, 3]
    # Resized to cover the video, 1 x 100,000 pixels would have been 32 x 3.2 million (a gigabyte per rank).
    ({"image": np.zeros((1, 100_000, 3), np.uint8)}, "image has shape [1, 100000, 3]; send UINT8 [height, width, 3] "
                                                     "RGB pixels of sides 1 to 4096"),
    ({"image": np.zeros((8, 1000, 3), np.uint8)}, "image is 1000x8: its aspect differs from the video's (48x32) by a "
                                                  "factor of 83.3, over the 4 taken"),
    ({"enable_sound": 1}, "sound generation is not served (enable_sound); this model serves text to video, text to "
                          "image (num_frames 1) and image to video (the image input)"),
    ({"conditioning_video": np.zeros((5, 32, 48, 3), np.uint8)}, "video-to-video generation is not served"),
    ({"action": '{"mode": "policy"}'}, "action-conditioned generation is not served"),
    ({"prompt": ["a", "b"]}, "prompt has 2 elements, over the 1 this model takes (the batch limit"),
    ({"loras": {"style": 1.0}}, "takes no LoRA adapters"),
    ({"fps": 0.0}, "fps 0.0 is not a positive number"),
    ({"num_inference_steps": 0}, "num_inference_steps 0 is out of range; send 1 to 1000"),
    ({"guidance_scale": math.nan}, "guidance_scale nan is not finite"),
    ({"cache": {"method": "taylorseer"}}, "cache method 'taylorseer' is not offered by cosmos3-pipeline"),
]


def request_arrays(values: dict) -> dict[str, np.ndarray]:
    """A request's inputs as the client sends them: texts as BYTES, JSON inputs as their text, numbers typed as the
    model declares them, arrays as they are."""
    types = {"height": np.int32, "width": np.int32, "num_frames": np.int32, "num_inference_steps": np.int32,
             "guidance_scale": np.float32, "seed": np.int64, "fps": np.float32, "enable_sound": np.int32}
    arrays = {}
    for name, value in values.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif name in types:
            arrays[name] = np.array([value], types[name])
        else:
            text = value if isinstance(value, (str, list)) else json.dumps(value)
            arrays[name] = texts(text if isinstance(text, list) else [text])
    return arrays


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change, message", BAD, ids=[f"{next(iter(change))}-{i}" for i, (change, _) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_and_the_ranks_stay_in_step(served, change, message):
    inputs = infer_inputs(request_arrays({**GOOD, "prompt": "a cat", **change}))
    with pytest.raises(ClientError) as caught:
        ask(served.grpc_address, UNARY, inputs, "video", GOOD["num_inference_steps"], None, None, 120)
    assert "INVALID_ARGUMENT" in str(caught.value) and message in str(caught.value)
    video = generate_video(served.grpc_address, UNARY, "a cat", **{**GOOD, "num_inference_steps": 1}, timeout=120)
    assert video.shape == (1, 9, 32, 48, 3)


@pytest.mark.timeout(300)
def test_generate_command_writes_an_image_and_an_image_to_video_clip(served, pipeline_dir, tmp_path, capsys):
    command = ["generate", "cosmos_ulysses2", "a red cat", "--url", served.grpc_address, "--height", "32", "--width",
               "48", "--steps", "2", "--seed", "9"]
    assert main(command + ["--num-frames", "1", "-o", str(tmp_path / "cat.png")]) == 0
    image = np.asarray(Image.open(tmp_path / "cat.png"))
    expected = reference_video(pipeline_dir, "a red cat", 32, 48, 1, 2, 6.0, 9)[0, 0]
    assert max_level_difference(image, expected) <= 1
    assert "wrote" in capsys.readouterr().out

    Image.fromarray(IMAGE).save(tmp_path / "first.png")
    assert main(command + ["--num-frames", "5", "--image", str(tmp_path / "first.png"), "--fps", "12", "-o",
                           str(tmp_path / "clip.npy")]) == 0
    frames = np.load(tmp_path / "clip.npy")
    expected = reference_video(pipeline_dir, "a red cat", 32, 48, 5, 2, 6.0, 9, image=IMAGE, fps=12.0)[0]
    assert max_level_difference(frames, expected) <= 1
    assert "(5 frames of 48x32)" in capsys.readouterr().out
