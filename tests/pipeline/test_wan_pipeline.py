"""Wan pipelines, prompt to video: in one process for each layout (Wan 2.1, Wan 2.2 A14B's two experts, Wan 2.2
TI2V's timestep per token), and served by a real tritonserver on 2 and 3 CPU ranks (gloo) over a gRPC stream. Every
video must equal diffusers' WanPipeline with the same components within one uint8 level; bad requests get
INVALID_ARGUMENT saying what to send, and the server keeps serving; `mdtriton generate` writes the MP4 and the .npy.
"""

from __future__ import annotations

import math

import av
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
from mdtriton.engine.job_control import JobControl, controlled_by
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.serving import load_engine
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference
from mdtriton.testing.tiny_wan_pipeline import LAYOUTS, reference_video, save_tiny_wan_pipeline

# 9 frames of 32x48: 3 latent frames x 2 x 3 patches = 18 tokens (on 2 or 3 ranks: 9 or 6 each).
GOOD = dict(height=32, width=48, num_frames=9, num_inference_steps=3, guidance_scale=5.0, seed=4)
MODELS = {  # served: name -> (layout, plan)
    "wan21_ulysses2": ("wan2.1", ParallelPlan(cp_size=2, cp_method="ulysses")),
    "wan22_tp3": ("wan2.2-a14b", ParallelPlan(tp_size=3)),
    "wan22_cfg2_ring2": ("wan2.2-a14b", ParallelPlan(cp_size=2, cp_method="ring", cfg_size=2)),
}
LIMITS = EngineLimits(max_batch_size=2, max_tokens=48)
UNARY = "wan22_tp3"  # answers each request once (the default); the others stream their progress (--stream)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    return {layout: save_tiny_wan_pipeline(root / layout, layout, seed=i) for i, layout in enumerate(LAYOUTS)}


@pytest.fixture(scope="module")
def served(pipelines, tmp_path_factory):
    repository = tmp_path_factory.mktemp("wan_repository")
    for name, (layout, plan) in MODELS.items():
        build_model_version(repository, name, BuildRequest(
            "wan-pipeline", None, plan, "FP32", "cpu", weights_path=pipelines[layout], progress=False, limits=LIMITS,
            stream=name != UNARY))
    server = start_server(repository, repository.parent / "wan_server.log")
    yield server
    server.stop()


def request(prompts: list[str], **values) -> dict[str, torch.Tensor]:
    types = {"height": torch.int32, "width": torch.int32, "num_frames": torch.int32,
             "num_inference_steps": torch.int32, "guidance_scale": torch.float32, "seed": torch.int64}
    return {"prompt": torch.from_numpy(prompt_tensor(prompts)),
            **{name: torch.tensor([values[name]], dtype=dtype) for name, dtype in types.items()}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_rank_video_equals_diffusers_and_reports_each_step(pipelines, tmp_path, layout):
    version_dir = build_model_version(tmp_path, "wan", BuildRequest(
        "wan-pipeline", None, ParallelPlan(), "FP32", "cpu", weights_path=pipelines[layout], progress=False))
    engine_dir = version_dir / ENGINE_DIR
    engine = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single())
    reported = []
    prompts = ["a red cat", "the blue dog"]
    with controlled_by(JobControl(on_progress=lambda done, total: reported.append((done, total)))):
        video = engine.forward(request(prompts, **GOOD))["video"].numpy()
    expected = reference_video(pipelines[layout], prompts, **{k: GOOD[k] for k in ("height", "width", "num_frames")},
                               steps=GOOD["num_inference_steps"], guidance=GOOD["guidance_scale"], seed=GOOD["seed"])
    assert video.shape == (2, 9, 32, 48, 3)
    assert max_level_difference(video, expected) <= 1
    assert video.std() > 10  # a real (random) video, not a blank one
    assert reported == [(1, 3), (2, 3), (3, 3)]
    expert_folders = sorted(p.name for p in engine_dir.iterdir() if p.name.startswith("transformer"))
    assert expert_folders == (["transformer", "transformer_2"] if layout == "wan2.2-a14b" else ["transformer"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_served_video_equals_diffusers_on_2_and_3_ranks(served, pipelines, model):
    layout = MODELS[model][0]
    steps = []
    options = {"negative_prompt": "blurry", "guidance_scale_2": 3.0} if layout == "wan2.2-a14b" else {}
    video = generate_video(served.grpc_address, model, ["a red cat", "hello wörld"], **GOOD, **options,
                           on_step=lambda done, total: steps.append((done, total)), timeout=240)
    expected = reference_video(pipelines[layout], ["a red cat", "hello wörld"], GOOD["height"], GOOD["width"],
                               GOOD["num_frames"], GOOD["num_inference_steps"], GOOD["guidance_scale"], GOOD["seed"],
                               **options)
    assert max_level_difference(video, expected) <= 1
    assert steps == ([] if model == UNARY else [(1, 3), (2, 3), (3, 3)])


@pytest.mark.timeout(300)
def test_guidance_parallelism_without_guidance_runs_the_one_branch_on_both_groups(served, pipelines):
    """guidance_scale 1: WanPipeline makes no unconditional call, so both guidance groups run the conditional one."""
    arguments = {**GOOD, "guidance_scale": 1.0, "num_inference_steps": 2}
    video = generate_video(served.grpc_address, "wan22_cfg2_ring2", "a cat", **arguments, timeout=240)
    expected = reference_video(pipelines["wan2.2-a14b"], ["a cat"], GOOD["height"], GOOD["width"], GOOD["num_frames"],
                               2, 1.0, GOOD["seed"])
    assert max_level_difference(video, expected) <= 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["wan21_ulysses2", "wan22_cfg2_ring2"])
def test_first_block_cache_equals_diffusers_with_context_and_guidance_parallelism(served, pipelines, model):
    """Each guidance branch (and each expert) keeps a cache state of its own, as diffusers' cache contexts do; under
    guidance parallelism each guidance group runs one branch, so each decides for its own."""
    layout = MODELS[model][0]
    arguments = {**GOOD, "num_inference_steps": 6}
    counts = []
    video = generate_video(served.grpc_address, model, "a red cat", **arguments, timeout=240,
                           cache={"method": "first_block", "threshold": 0.2}, on_full_steps=counts.append)
    expected = reference_video(pipelines[layout], ["a red cat"], GOOD["height"], GOOD["width"], GOOD["num_frames"], 6,
                               GOOD["guidance_scale"], GOOD["seed"], cache_threshold=0.2)
    uncached = reference_video(pipelines[layout], ["a red cat"], GOOD["height"], GOOD["width"], GOOD["num_frames"], 6,
                               GOOD["guidance_scale"], GOOD["seed"])
    assert max_level_difference(video, expected) <= 1 < max_level_difference(video, uncached)
    assert 1 <= counts[0] < 6  # the conditional branch's calls that ran every block


# 48 tokens at most: 32x48 x 9 frames is 18 tokens, 64x64 x 9 frames 48, 64x64 x 13 frames 64.
BAD = [
    ({"num_frames": 8}, "num_frames 8 is not 4k+1; send 5 or 9"),
    ({"num_frames": 0}, "num_frames 0 is not 4k+1; send 1 or 5"),
    ({"height": 40}, "height 40 is not a positive multiple of 16; send a height of 32 or 48"),
    ({"width": 8}, "width 8 is not a positive multiple of 16; send a width of 16"),
    ({"height": 64, "width": 64, "num_frames": 13}, "64x64 x 13 frames is 64 tokens, over this engine's maximum of 48"),
    ({"num_inference_steps": 0}, "num_inference_steps 0 is out of range; send 1 to 1000"),
    ({"guidance_scale": math.nan}, "guidance_scale nan is not finite"),
    ({"max_sequence_length": 513}, "max_sequence_length 513 is out of range; send 1 to 512"),
    ({"prompt": ["a", "b", "c"]}, "prompt has 3 elements, over the 2 this model takes (the batch limit"),
    ({"prompt": ["a"], "negative_prompt": ["x", "y"]}, "negative_prompt has 2 rows, prompt 1"),
    ({"cache": {"method": "taylorseer"}}, "cache method 'taylorseer' is not offered by wan-pipeline; its methods: "
                                          "first_block, none"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change, message", BAD, ids=[next(iter(change)) + "-" + str(i) for i, (change, _) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_and_the_ranks_stay_in_step(served, change, message):
    arguments = {**GOOD, "prompt": "a cat", **change}
    with pytest.raises(ClientError) as caught:
        generate_video(served.grpc_address, "wan22_tp3", timeout=120, **arguments)
    assert "INVALID_ARGUMENT" in str(caught.value) and message in str(caught.value)
    video = generate_video(served.grpc_address, "wan22_tp3", "a cat", **{**GOOD, "num_inference_steps": 1}, timeout=120)
    assert video.shape == (1, 9, 32, 48, 3)


@pytest.mark.timeout(300)
def test_generate_command_writes_the_mp4_and_the_frames(served, pipelines, tmp_path, capsys):
    command = ["generate", "wan21_ulysses2", "a red cat", "--url", served.grpc_address, "--height", "32", "--width",
               "48", "--num-frames", "9", "--steps", "2", "--seed", "9"]
    assert main(command + ["-o", str(tmp_path / "clip.npy")]) == 0
    frames = np.load(tmp_path / "clip.npy")
    expected = reference_video(pipelines["wan2.1"], ["a red cat"], 32, 48, 9, 2, 5.0, 9)[0]
    assert max_level_difference(frames, expected) <= 1
    captured = capsys.readouterr()
    assert "(9 frames of 48x32)" in captured.out and "2/2" in captured.err  # the per-step progress bar

    assert main(command + ["-o", str(tmp_path / "clip.mp4"), "--fps", "8"]) == 0
    with av.open(str(tmp_path / "clip.mp4")) as container:
        stream = container.streams.video[0]
        decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        assert (stream.codec_context.name, stream.average_rate) == ("h264", 8)
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(int) - frames).mean() < 20  # lossy H.264 of a noise-like video, yuv420p

    assert main(command + ["-o", str(tmp_path / "clip.png")]) == 1
    assert "wan21_ulysses2 makes videos: write a .mp4 or .npy file" in capsys.readouterr().err


def test_a_bf16_pipeline_keeps_the_vae_in_float32(pipelines, tmp_path):
    version_dir = build_model_version(tmp_path, "wan", BuildRequest(
        "wan-pipeline", None, ParallelPlan(), "BF16", "cpu", weights_path=pipelines["wan2.1"], progress=False))
    engine_dir = version_dir / ENGINE_DIR
    pipeline = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single()).pipeline
    assert (pipeline.vae.dtype, pipeline.text_encoder.dtype, pipeline.transformer.dtype) == (
        torch.float32, torch.bfloat16, torch.bfloat16)
