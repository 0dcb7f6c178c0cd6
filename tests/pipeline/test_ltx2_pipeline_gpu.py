"""LTX-2 (video with sound) served with diffusers' own transformer split by its mended plan (mdtriton.families.ltx2)
on 2 GPUs, NCCL ranks, each method: two requests sent at once (so that rank 1 receives one), a batch of two prompts of
different lengths (Gemma's left padding: the text mask gathered with the text keys) and 5 in a row, each clip equal
to diffusers' LTX2Pipeline on one GPU within 1 uint8 level for the frames and diffusers' float32 tolerance for the
sound; image to video (LTX2ImageToVideoPipeline) with ulysses likewise."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline
from PIL import Image

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.testing.tiny_ltx2_pipeline import save_tiny_ltx2_image_to_video_pipeline, save_tiny_ltx2_pipeline
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference
from tests.pipeline.test_ltx2_pipeline import AUDIO_TOLERANCE, IMAGE, REQUEST, served

pytestmark = pytest.mark.gpu
METHODS = ("ulysses", "ring", "allgather_kv")
BATCH = {**REQUEST, "prompt": ["a cat", "a robot dancing in the rain at night"], "negative_prompt": ["blurry", "dark"]}
IN_A_ROW = 5


@pytest.fixture(scope="module")
def ltx2_on_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = tmp_path_factory.mktemp("ltx2-gpu")
    pipeline_dir = save_tiny_ltx2_pipeline(root / "pipeline")
    builds = [(f"ltx2-{method}", "ltx2-pipeline", method, pipeline_dir) for method in METHODS]
    builds.append(("ltx2-i2v", "ltx2-image-to-video-pipeline", "ulysses",
                   save_tiny_ltx2_image_to_video_pipeline(root / "image-to-video")))
    for name, architecture, method, directory in builds:
        build_model_version(root / "repository", name, BuildRequest(
            architecture, None, ParallelPlan(cp_size=2, cp_method=method), "FP32", "gpu", gpus=[0, 1],
            weights_path=directory, progress=False))
    server = start_server(root / "repository", root / "server.log")
    yield pipeline_dir, root / "image-to-video", server
    server.stop()


def one_gpu(pipeline_dir, request: dict, pipeline_class=LTX2Pipeline) -> tuple[np.ndarray, torch.Tensor]:
    """diffusers' pipeline on GPU 0: (frames UINT8 [B, F, H, W, 3], sound [B, channels, samples] on the host)."""
    pipeline = pipeline_class.from_pretrained(pipeline_dir, local_files_only=True).to("cuda:0")
    pipeline.set_progress_bar_config(disable=True)
    arguments = {key: value for key, value in request.items() if key != "seed"}
    if "image" in arguments:
        arguments["image"] = Image.fromarray(arguments["image"])
    result = pipeline(**arguments, generator=torch.Generator().manual_seed(request["seed"]), output_type="pt")
    frames = (result.frames.float().permute(0, 1, 3, 4, 2) * 255).round().to(torch.uint8).cpu().numpy()
    return frames, result.audio.float().cpu()


def assert_equal(result, expected: tuple[np.ndarray, torch.Tensor]) -> None:
    frames, audio = expected
    assert max_level_difference(result.as_numpy("video"), frames) <= 1
    torch.testing.assert_close(torch.from_numpy(result.as_numpy("audio").copy()), audio, **AUDIO_TOLERANCE)


@pytest.mark.parametrize("method", METHODS)
def test_served_on_2_gpus_equals_one_gpu(ltx2_on_gpus, method):
    pipeline_dir, _, server = ltx2_on_gpus
    model = f"ltx2-{method}"
    expected, expected_batch = one_gpu(pipeline_dir, REQUEST), one_gpu(pipeline_dir, BATCH)
    with ThreadPoolExecutor(2) as pool:
        at_once = list(pool.map(lambda _: served(server, model, REQUEST), range(2)))
    for result in at_once:
        assert_equal(result, expected)
    assert_equal(served(server, model, BATCH), expected_batch)
    for _ in range(IN_A_ROW):
        assert_equal(served(server, model, REQUEST), expected)


def test_image_to_video_on_2_gpus_equals_one_gpu(ltx2_on_gpus):
    _, pipeline_dir, server = ltx2_on_gpus
    request = {**REQUEST, "image": IMAGE}
    expected = one_gpu(pipeline_dir, request, LTX2ImageToVideoPipeline)
    for _ in range(2):
        assert_equal(served(server, "ltx2-i2v", request), expected)
