"""LTX-2 (video with sound) served with diffusers' own transformer split by its mended plan (mdtriton.families.ltx2)
on 2 gloo ranks: text to video with ulysses and ring, image to video with ulysses (every method on uneven splits:
tests/pipeline/test_ltx2_context_parallel.py; text to video with allgather_kv, image to video with ring, both on cfg 2 x
ulysses 2: tests/pipeline/test_pipeline_plans.py); the frames equal diffusers' pipeline in one process
within 1 uint8 level and the sound within diffusers' own float32 tolerance; bad requests are refused and the server
serves on; `mdtriton generate` writes the MP4 with its sound track, and the sound as a WAV."""

from __future__ import annotations

import wave

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline, TaylorSeerCacheConfig
from PIL import Image
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.pipeline import infer_inputs, request_arrays
from mdtriton.engine.plan import ParallelPlan
from mdtriton.testing.tiny_ltx2_pipeline import save_tiny_ltx2_image_to_video_pipeline, save_tiny_ltx2_pipeline
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference

METHODS = ("ulysses", "ring")
# 5 frames of 32x32 at 25 per second: 3 x 16 x 16 video tokens, 5 audio latents (0.2 s of sound at 16 kHz).
REQUEST = dict(prompt=["a robot dancing"], negative_prompt=["blurry"], height=32, width=32, num_frames=5,
               frame_rate=25.0, num_inference_steps=2, guidance_scale=3.0, seed=7)
AUDIO_TOLERANCE = dict(atol=1e-4, rtol=1e-4)  # diffusers' LTX-2 tests' (tests/pipelines/ltx2/test_ltx2.py)
# The first frame of image to video: 40 x 24 pixels (the pipeline resizes it to 32 x 32).
IMAGE = np.random.default_rng(5).integers(0, 256, (24, 40, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory):
    """The tiny LTX-2 directories (text to video, image to video) and one server of text to video built on 2 ranks by
    each method (ltx2-METHOD) and image to video by ulysses (ltx2-i2v)."""
    root = tmp_path_factory.mktemp("ltx2")
    directories = {"text": save_tiny_ltx2_pipeline(root / "text"),
                   "image": save_tiny_ltx2_image_to_video_pipeline(root / "image")}
    builds = [(f"ltx2-{method}", "ltx2-pipeline", method, "text") for method in METHODS]
    builds.append(("ltx2-i2v", "ltx2-image-to-video-pipeline", "ulysses", "image"))
    for name, architecture, method, kind in builds:
        build_model_version(root / "repository", name, BuildRequest(
            architecture, None, ParallelPlan(cp_size=2, cp_method=method), "FP32", "cpu",
            weights_path=directories[kind], progress=False))
    server = start_server(root / "repository", root / "server.log")
    yield directories, server
    server.stop()


def reference(pipeline_class, pipeline_dir, request: dict, cache=None) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' pipeline in this process: (frames UINT8 [B, F, H, W, 3], sound [B, channels, samples]); with a
    diffusers cache config, after `transformer.enable_cache(cache)`."""
    pipeline = pipeline_class.from_pretrained(pipeline_dir, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    if cache is not None:
        pipeline.transformer.enable_cache(cache)
    arguments = {key: value for key, value in request.items() if key != "seed"}
    if "image" in arguments:
        arguments["image"] = Image.fromarray(arguments["image"])
    result = pipeline(**arguments, generator=torch.Generator().manual_seed(request["seed"]), output_type="pt")
    frames = (result.frames.permute(0, 1, 3, 4, 2) * 255).round().to(torch.uint8).numpy()
    return frames, result.audio.numpy()


@pytest.fixture(scope="module")
def expected(ltx2):
    return reference(LTX2Pipeline, ltx2[0]["text"], REQUEST)


def served(server, model: str, request: dict, cache: dict | None = None) -> grpcclient.InferResult:
    texts = {name: request.get(name) for name in ("prompt", "negative_prompt")}
    numbers = {name: value for name, value in request.items() if name not in texts and name != "image"}
    arrays = request_arrays(texts, numbers, cache, None)
    if "image" in request:
        arrays["image"] = request["image"]
    with grpcclient.InferenceServerClient(server.grpc_address) as client:
        return client.infer(model, infer_inputs(arrays), client_timeout=300)


@pytest.mark.parametrize("method", METHODS)
def test_each_method_equals_diffusers_in_one_process(ltx2, expected, method):
    _, server = ltx2
    frames, audio = expected
    result = served(server, f"ltx2-{method}", REQUEST)
    assert result.as_numpy("video").shape == (1, 5, 32, 32, 3)
    assert max_level_difference(result.as_numpy("video"), frames) <= 1
    torch.testing.assert_close(torch.from_numpy(result.as_numpy("audio").copy()), torch.from_numpy(audio),
                               **AUDIO_TOLERANCE)
    assert result.as_numpy("sample_rate").tolist() == [16000]
    assert (f"mdtriton rank 1 worker: LTX2VideoTransformer3DModel split by its context-parallel plan across 2 ranks "
            f"({method})") in server.log_file.read_text()


def test_image_to_video_equals_diffusers_in_one_process(ltx2):
    directories, server = ltx2
    request = {**REQUEST, "image": IMAGE}
    frames, audio = reference(LTX2ImageToVideoPipeline, directories["image"], request)
    result = served(server, "ltx2-i2v", request)
    assert max_level_difference(result.as_numpy("video"), frames) <= 1
    torch.testing.assert_close(torch.from_numpy(result.as_numpy("audio").copy()), torch.from_numpy(audio),
                               **AUDIO_TOLERANCE)
    # The first frame follows the image: nearer it than the text-to-video clip's first frame is.
    text_frames, _ = reference(LTX2Pipeline, directories["text"], REQUEST)
    resized = np.asarray(Image.fromarray(IMAGE).resize((32, 32)), dtype=float)
    assert np.abs(frames[0, 0] - resized).mean() < np.abs(text_frames[0, 0] - resized).mean()


def test_taylorseer_equals_diffusers_with_the_same_config(ltx2):
    """LTX2Pipeline's one call a step (both branches in a doubled batch, under "cond_uncond") with TaylorSeer,
    computed at steps 0 and 2 of 4 and predicted at 1 and 3 (its audio-video cross-attentions: the modules diffusers'
    patterns name), equals diffusers' with the same TaylorSeerCacheConfig, frames and sound, and moves the clip. First
    Block Cache is refused saying why: diffusers' hooks would carry the text where the blocks return the sound."""
    directories, server = ltx2
    request = {**REQUEST, "num_inference_steps": 4}
    result = served(server, "ltx2-ulysses", request,
                    {"method": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1})
    frames, audio = reference(LTX2Pipeline, directories["text"], request,
                              TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1))
    assert max_level_difference(result.as_numpy("video"), frames) <= 1
    torch.testing.assert_close(torch.from_numpy(result.as_numpy("audio").copy()), torch.from_numpy(audio),
                               **AUDIO_TOLERANCE)
    assert int(result.as_numpy("full_steps")[0]) == 2
    assert max_level_difference(frames, reference(LTX2Pipeline, directories["text"], request)[0]) > 1
    with pytest.raises(InferenceServerException) as refused:
        served(server, "ltx2-ulysses", request, {"method": "first_block"})
    assert "INVALID_ARG" in str(refused.value.status())
    assert "its methods: taylorseer, none (First Block Cache: diffusers' block hooks know no LTX-2 block" in (
        refused.value.message())


@pytest.mark.parametrize("change, message", [
    ({"num_frames": 6}, "num_frames 6 is not 2k+1; send 5 or 7"),
    ({"height": 48}, "height 48 is not a positive multiple of 32"),
    ({"frame_rate": 0.0}, "frame_rate 0 is out of range; send 1 to 120"),
    ({"frame_rate": float("nan")}, "frame_rate nan is out of range"),
    ({"num_frames": 1, "frame_rate": 60.0}, "1 frames at frame_rate 60 last 0.017 s, too short for the sound"),
    ({"height": 4096, "width": 4096}, "over this model's maximum of 32768"),
    ({"guidance_scale": float("inf")}, "guidance_scale inf is not finite"),
    ({"negative_prompt": ["a", "b"]}, "negative_prompt has 2 rows, prompt 1"),
    ({"image": np.zeros((8, 64, 3), np.uint8)}, "image is 64x8: its aspect differs from the video's"),
])
def test_bad_requests_are_invalid_argument_and_the_server_serves_on(ltx2, change, message):
    _, server = ltx2
    model, good = ("ltx2-i2v", {**REQUEST, "image": IMAGE}) if "image" in change else ("ltx2-ring", REQUEST)
    with pytest.raises(InferenceServerException) as refused:
        served(server, model, {**good, **change})
    assert "INVALID_ARG" in str(refused.value.status()) and message in refused.value.message()
    assert served(server, model, {**good, "num_inference_steps": 1}).as_numpy("video").shape == (1, 5, 32, 32, 3)


def test_mdtriton_generate_writes_the_mp4_with_its_sound_and_the_wav(ltx2, expected, tmp_path):
    from mdtriton.cli import main

    _, server = ltx2
    frames, audio = expected
    av = pytest.importorskip("av", reason="PyAV (the video extra) writes and reads the MP4")
    clip, sound = tmp_path / "clip.mp4", tmp_path / "clip.wav"
    assert main(["generate", "ltx2-ulysses", REQUEST["prompt"][0], "--url", server.grpc_address, "--height", "32",
                 "--width", "32", "--num-frames", "5", "--fps", "25", "--steps", "2", "--guidance", "3", "--seed", "7",
                 "--negative-prompt", REQUEST["negative_prompt"][0], "-o", str(clip), "--audio", str(sound)]) == 0
    with av.open(str(clip)) as container:
        video, track = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.average_rate, track.codec_context.name, track.rate) == (
            "h264", 25, "aac", 16000)
        assert track.codec_context.layout.nb_channels == audio.shape[1]
        decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video)])
        assert decoded.shape == frames[0].shape
    with av.open(str(clip)) as container:  # a second pass: decoding the video read every packet
        decoded_sound = np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=1)
        assert decoded_sound.shape[1] >= audio.shape[2]  # AAC adds its priming and pads its last frame
    with wave.open(str(sound)) as file:
        assert (file.getnchannels(), file.getframerate(), file.getnframes()) == (audio.shape[1], 16000, audio.shape[2])
        pcm = np.frombuffer(file.readframes(file.getnframes()), "<i2").reshape(-1, audio.shape[1]).T
    assert np.abs(pcm / 32767 - audio[0]).max() < 1e-3  # 16-bit PCM of the served sound
