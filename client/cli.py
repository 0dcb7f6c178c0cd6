"""The client commands of `mdtriton`: infer, sample, generate, health, metadata, models, load, unload.

Each talks to a running Triton server over gRPC (--url). Server errors end as one line on stderr and
exit code 1 (mdtriton/cli.py prints the ClientError).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import numpy as np

from tqdm import tqdm

from mdtriton.client.grpc_client import SHM_THRESHOLD_BYTES, Client
from mdtriton.client.pipeline import IMAGE_INPUTS, generate, generate_clip, generate_video, streams_progress
from mdtriton.client.sampler import sample_flux
from mdtriton.client.tensors import read_tensors, write_tensors


# The seeds a request's `seed` input (INT64) holds.
SEED_RANGE = range(-2**63, 2**63)


def read_inputs(texts: list[str]) -> dict[str, np.ndarray]:
    """Inputs from NAME=FILE.npy, NAME=FILE.safetensors (its tensor NAME, or its only tensor), or
    FILE.safetensors (every tensor, by its name)."""
    inputs = {}
    for text in texts:
        name, sep, path = text.partition("=")
        if not sep:
            name, path = "", text
        tensors = read_tensors(Path(path))
        if not name:
            if "" in tensors:
                raise ValueError(f"--input {text}: a .npy file holds no name: give NAME={path}")
            inputs.update(tensors)
        elif name in tensors or len(tensors) == 1:
            inputs[name] = tensors.get(name, next(iter(tensors.values())))
        else:
            raise ValueError(f"--input {text}: {path} holds {sorted(tensors)}, not {name!r}")
    return inputs


def connect(args: argparse.Namespace) -> Client:
    threshold = None if getattr(args, "no_shm", False) else SHM_THRESHOLD_BYTES
    return Client(args.url, timeout=args.timeout, retries=args.retries, shm_threshold=threshold)


def add_parsers(subparsers) -> None:
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--url", default="127.0.0.1:8001", help="server gRPC address (default 127.0.0.1:8001)")
    connection.add_argument("--timeout", type=float, help="seconds each call may take (default: no limit)")
    connection.add_argument("--retries", type=int, default=2,
                            help="times a call that finds the server or model UNAVAILABLE is retried, "
                                 "after 0.5 s, 1 s, 2 s, ... (default 2)")
    tensors = argparse.ArgumentParser(add_help=False)
    tensors.add_argument("--model-version", default="", help="model version (default: the server's choice)")
    tensors.add_argument("--input", action="append", default=[], metavar="[NAME=]FILE",
                         help="input tensors: NAME=FILE.npy, NAME=FILE.safetensors, or FILE.safetensors for all "
                              "the tensors in it by their names (repeat)")
    tensors.add_argument("--output", type=Path, metavar="PATH",
                         help="save the outputs: FILE.safetensors, or a directory of NAME.npy files")
    tensors.add_argument("--no-shm", action="store_true",
                         help="send every tensor in the gRPC messages (default: tensors of 128 KiB or more go "
                              "through shared memory when the server is on this host)")

    parser = subparsers.add_parser("infer", parents=[connection, tensors], help="send inference requests over gRPC",
                                   description="Send a request to a model and print (or save) its outputs; "
                                               "with --requests, send it many times and report latency and throughput.")
    parser.add_argument("model", help="model name")
    parser.add_argument("--requests", type=int, default=1, help="how many times to send the request (default 1)")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default 1)")
    parser.set_defaults(run=infer)

    parser = subparsers.add_parser(
        "sample", parents=[connection, tensors], help="denoise FLUX latents with a served FLUX transformer",
        description="Run the FLUX flow-matching (Euler) sampler: each step is one request to the served "
                    "transformer. Inputs: encoder_hidden_states [B, T, joint_attention_dim] and pooled_projections "
                    "[B, pooled_projection_dim], the prompt's text-encoder outputs. Prints the final packed "
                    "latents [B, (H/16)*(W/16), in_channels] or saves them with --output.")
    parser.add_argument("model", help="model name of a FLUX transformer")
    parser.add_argument("--height", type=int, default=1024, help="image height in pixels, a multiple of 16 (default 1024)")
    parser.add_argument("--width", type=int, default=1024, help="image width in pixels, a multiple of 16 (default 1024)")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps (default 28)")
    parser.add_argument("--guidance", type=float, default=3.5, help="guidance scale, for models that take one (default 3.5)")
    parser.add_argument("--seed", type=seed_argument, default=0,
                        help=f"seed of the starting noise, {SEED_RANGE.start} to {SEED_RANGE.stop - 1} (default 0)")
    parser.set_defaults(run=sample)

    parser = subparsers.add_parser(
        "generate", help="prompt to image or video with a served pipeline model",
        description="Send a prompt, and input images where the model takes them (--image), to a pipeline model "
                    "(mdtriton build --architecture flux-pipeline, qwen-image-pipeline, flux2-pipeline, "
                    "qwen-image-edit-plus-pipeline, flux-kontext-pipeline, ...: an image; wan-pipeline, "
                    "wan-i2v-pipeline, cosmos3-pipeline: a video; ltx2-pipeline: a video with sound), show each "
                    "denoising step as the server finishes it, and "
                    "write the image as a PNG, or the video as an MP4 (H.264, with its sound as AAC) or as the raw "
                    "frames (.npy: UINT8 [frames, height, width, 3]), its sound also as a WAV (--audio); a video of one "
                    "frame (Cosmos 3: --num-frames 1) as a PNG too. The "
                    "model's outputs say which it makes; what is not given takes the model's defaults (its family's: "
                    "FLUX 1024x1024, 28 steps, guidance 3.5; Qwen-Image 1024x1024, 50 steps, 4.0 (its true_cfg_scale, "
                    "with a --negative-prompt); Qwen-Image-Edit-Plus the last input image's aspect at about a "
                    "megapixel, 50 steps, 4.0 (true_cfg_scale); FLUX.2 the first input image's size, else "
                    "1024x1024, 50 steps, guidance 4.0; Wan 480x832, 81 frames, 50 steps, 5.0; Cosmos 3 720x1280, "
                    "189 frames, 35 steps, 6.0; LTX-2 512x768, 121 frames at 24 per second, 30 steps, 3.0).")
    parser.add_argument("model", help="model name of a pipeline")
    parser.add_argument("prompt", help="the prompt")
    parser.add_argument("--url", default="127.0.0.1:8001", help="server gRPC address (default 127.0.0.1:8001)")
    parser.add_argument("--timeout", type=float, help="seconds the image or video may take (default: no limit)")
    parser.add_argument("--height", type=int, help="height in pixels, a multiple of 16")
    parser.add_argument("--width", type=int, help="width in pixels, a multiple of 16")
    parser.add_argument("--steps", type=int, help="denoising steps")
    parser.add_argument("--guidance", type=float,
                        help="guidance scale (ignored by models without guidance, e.g. FLUX.1-schnell)")
    parser.add_argument("--seed", type=seed_argument, default=0,
                        help=f"seed of the starting noise, {SEED_RANGE.start} to {SEED_RANGE.stop - 1} (default 0)")
    parser.add_argument("--max-sequence-length", type=int, help="text encoder tokens of the prompt (default 512)")
    parser.add_argument("--prompt-2", help="images: a different prompt for the T5 encoder (default: the prompt)")
    parser.add_argument("--num-frames", type=int, help="videos: frames, 4k+1 (LTX-2: 8k+1; Cosmos 3: 1 makes an "
                                                       "image)")
    parser.add_argument("--negative-prompt", help="what to steer away from, for models that take one (Wan, Qwen-Image, "
                                                  "Qwen-Image-Edit-Plus, LTX-2; default: none)")
    parser.add_argument("--guidance-2", type=float,
                        help="videos: Wan 2.2 A14B's guidance for its low-noise expert (default: --guidance)")
    parser.add_argument("--image", type=Path, action="append", default=[], metavar="FILE",
                        help="an input image (a PNG or JPEG); repeat for several, sent as image, image_2, image_3 in "
                             "order. Images: the reference images to edit or follow (flux2-pipeline, "
                             "flux2-klein-pipeline: up to 3; qwen-image-edit-plus-pipeline: 1 to 3; "
                             "flux-kontext-pipeline: the image to edit, used at its size rounded down to multiples of "
                             "16; the size left out is the images'). Videos: image to video, the clip's first frame "
                             "(cosmos3-pipeline, wan-i2v-pipeline, ltx2-image-to-video-pipeline: 1), resized to the "
                             "video's size")
    parser.add_argument("--last-image", type=Path,
                        help="videos: the clip's last frame (a PNG or JPEG; Wan 2.2 I2V A14B, Wan 2.1 FLF2V)")
    parser.add_argument("--cache", metavar="JSON",
                        help="step cache, e.g. '{\"method\": \"first_block\", \"threshold\": 0.08}' (methods: "
                             "first_block, taylorseer, none; docs/client.md); default: the model's")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME[=SCALE]", type=lora_argument,
                        help="apply the model's LoRA adapter NAME (mdtriton lora list) at SCALE (default 1.0); "
                             "repeat for several")
    parser.add_argument("--fps", type=float,
                        help="videos: frames per second of the MP4, and the rate a model that takes one (Cosmos 3, "
                             "LTX-2: its sound lasts as long as the frames at this rate) makes the clip for (default: "
                             "that model's, 24; else 16, Wan's)")
    parser.add_argument("--audio", type=Path, metavar="FILE.wav",
                        help="videos with sound (LTX-2): also write the sound as a WAV (16-bit PCM); its directory "
                             "must exist and be writable")
    parser.add_argument("-o", "--output", type=Path,
                        help="file to write: .png for images; .mp4 or .npy for videos [image.png; clip.mp4]; its "
                             "directory must exist and be writable (checked before the request)")
    parser.set_defaults(run=generate_media)

    parser = subparsers.add_parser("health", parents=[connection], help="is the server (or a model) live and ready",
                                   description="Print whether the server is live and ready (and a model, if named); "
                                               "exit code 1 if not ready.")
    parser.add_argument("model", nargs="?", help="a model to check too")
    parser.add_argument("--model-version", default="", help="model version (default: the server's choice)")
    parser.set_defaults(run=health)

    parser = subparsers.add_parser("metadata", parents=[connection], help="a model's inputs, outputs, versions and plan",
                                   description="Print a model's metadata (versions, inputs, outputs) and what its "
                                               "config tells: architecture, data type, parallel plan, ranks, "
                                               "version policy and parameters.")
    parser.add_argument("model", help="model name")
    parser.add_argument("--model-version", default="", help="model version (default: the server's choice)")
    parser.set_defaults(run=metadata)

    parser = subparsers.add_parser("models", parents=[connection], help="list the models in the server's repository",
                                   description="List every model and version in the server's repository with its "
                                               "state (READY, UNAVAILABLE, LOADING, UNLOADING) and the reason.")
    parser.set_defaults(run=models)

    parser = subparsers.add_parser(
        "load", parents=[connection], help="load or reload a model (explicit model control mode)",
        description="Load or reload a model from the server's repository; the server must run with "
                    "--model-control-mode explicit. With --versions, serve exactly those versions: the others are "
                    "unloaded and the listed ones keep serving while they reload (a version_policy override for "
                    "this load; config.pbtxt is not changed, and a plain load goes back to it).")
    parser.add_argument("model", help="model name")
    parser.add_argument("--versions", help="comma-separated versions to serve, e.g. 2 or 2,3")
    parser.set_defaults(run=load)

    parser = subparsers.add_parser("unload", parents=[connection], help="unload a model (explicit model control mode)",
                                   description="Unload every version of a model and wait until they are gone; the "
                                               "server must run with --model-control-mode explicit.")
    parser.add_argument("model", help="model name")
    parser.set_defaults(run=unload)


def show_outputs(outputs: dict[str, np.ndarray], path: Path | None) -> None:
    if path:
        for written in write_tensors(path, outputs):
            print(f"saved {written}")
    for name, array in outputs.items():
        print(f"{name}: {array.dtype} {list(array.shape)}")
        if not path:
            print(array)


def infer(args: argparse.Namespace) -> int:
    inputs = read_inputs(args.input)
    with connect(args) as client:

        def timed(_) -> tuple[dict, float]:
            start = time.perf_counter()
            outputs = client.infer(args.model, inputs, version=args.model_version)
            return outputs, time.perf_counter() - start

        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(timed, range(args.requests)))
        elapsed = time.perf_counter() - start
    show_outputs(results[-1][0], args.output)
    latencies = sorted(latency * 1000 for _, latency in results)
    if args.requests == 1:
        print(f"latency: {latencies[0]:.1f} ms")
    else:
        print(f"{args.requests} requests, concurrency {args.concurrency}: {args.requests / elapsed:.1f} requests/s; "
              f"latency median {statistics.median(latencies):.1f} ms, "
              f"p90 {latencies[int(0.9 * (len(latencies) - 1))]:.1f} ms")
    return 0


def sample(args: argparse.Namespace) -> int:
    inputs = read_inputs(args.input)
    missing = {"encoder_hidden_states", "pooled_projections"} - set(inputs)
    if missing:
        raise ValueError(f"sample needs --input for {sorted(missing)}")
    with connect(args) as client:
        start = time.perf_counter()
        latents = sample_flux(client, args.model, inputs["encoder_hidden_states"], inputs["pooled_projections"],
                              args.height, args.width, args.steps, args.guidance, seed=args.seed,
                              version=args.model_version)
        elapsed = time.perf_counter() - start
    show_outputs({"latents": latents}, args.output)
    print(f"{args.steps} steps in {elapsed:.2f} s ({elapsed / args.steps * 1000:.1f} ms per step)")
    return 0


def lora_argument(text: str) -> tuple[str, float]:
    """--lora NAME or NAME=SCALE."""
    name, sep, scale = text.partition("=")
    try:
        return name, float(scale) if sep else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME or NAME=SCALE, SCALE a number") from None


def seed_argument(text: str) -> int:
    """--seed: an integer the seed input (INT64) holds."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if seed not in SEED_RANGE:
        raise argparse.ArgumentTypeError(f"{seed} is out of range; give {SEED_RANGE.start} to {SEED_RANGE.stop - 1} "
                                         "(a signed 64-bit integer)")
    return seed


def check_writable(path: Path) -> None:
    """ValueError, naming path, unless its directory exists and this user may write there, and a file already at path
    is one this user may overwrite: checked before the request, so that a long job is not lost at the end."""
    directory = path.parent
    if not directory.is_dir():
        raise ValueError(f"cannot write {path}: there is no directory {directory}")
    if not os.access(directory, os.W_OK):
        raise ValueError(f"cannot write {path}: this user may not write in {directory}")
    if path.is_dir():
        raise ValueError(f"cannot write {path}: it is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"cannot write {path}: the file exists and this user may not overwrite it")


def generate_media(args: argparse.Namespace) -> int:
    """The image or the video, by what the model answers (its outputs: `image` or `video`), with the model's defaults
    (its config's `request_defaults`, which the build writes) for what the command line leaves out."""
    for path in (args.output, args.audio):
        if path is not None:
            check_writable(path)
    with Client(args.url, timeout=args.timeout) as client:
        metadata = client.metadata(args.model)
        parameters = client.model_config(args.model)["parameters"]
    architecture = parameters["architecture"]["string_value"]
    if "request_defaults" not in parameters:
        raise ValueError(f"{args.model} serves a transformer engine ({architecture}), not a pipeline: generate takes a "
                         "model built with --architecture ...-pipeline")
    defaults = {**json.loads(parameters["request_defaults"]["string_value"]),
                **{name: getattr(args, name) for name in ("height", "width", "num_frames")
                   if getattr(args, name) is not None}}
    takes = {spec["name"] for spec in metadata["inputs"]}
    answers = {spec["name"] for spec in metadata["outputs"]}
    video, sound = "video" in answers, "audio" in answers
    one_frame = video and defaults.get("num_frames") == 1
    output = args.output or Path("clip.mp4" if video and not one_frame else "image.png")
    suffixes = (".mp4", ".npy") + ((".png",) if one_frame else ()) if video else (".png",)
    if output.suffix.lower() not in suffixes:
        raise ValueError(f"{args.model} makes {'videos' if video else 'images'}: write a {' or '.join(suffixes)} "
                         f"file, not {output}")
    image_inputs = [name for name in IMAGE_INPUTS if name in takes]
    if len(args.image) > len(image_inputs):
        raise ValueError(f"{args.model} takes {f'at most {len(image_inputs)}' if image_inputs else 'no'} input image"
                         f"{'' if len(image_inputs) == 1 else 's'} ({architecture}), not {len(args.image)}; input "
                         "images: flux2-pipeline, flux2-klein-pipeline, qwen-image-edit-plus-pipeline (up to 3), "
                         "flux-kontext-pipeline, cosmos3-pipeline, wan-i2v-pipeline, ltx2-image-to-video-pipeline (1)")
    if args.last_image is not None and "last_image" not in takes:
        raise ValueError(f"{args.model} takes no last image ({architecture}); first and last frame: a wan-i2v-pipeline "
                         "model")
    if args.negative_prompt is not None and "negative_prompt" not in takes:
        raise ValueError(f"{args.model} takes no negative prompt ({architecture})")
    if args.audio is not None and (not sound or args.audio.suffix.lower() != ".wav"):
        raise ValueError(f"--audio {args.audio}: " + ("give a .wav file" if sound else
                                                       f"{args.model} makes no sound ({architecture})"))
    steps = args.steps or defaults["num_inference_steps"]
    # Qwen-Image's guidance is its true classifier-free guidance scale, true_cfg_scale; the others' guidance_scale
    # (FLUX.1 Kontext takes both: --guidance is its guidance_scale).
    guidance_input = "guidance_scale" if "guidance_scale" in takes else "true_cfg_scale"
    guidance = args.guidance if args.guidance is not None else defaults[guidance_input]
    fps = args.fps or defaults.get("fps") or defaults.get("frame_rate") or 16
    start = time.perf_counter()
    streamed = streams_progress(args.url, args.model)
    if not streamed:
        print(f"{args.model} answers once, at the end (build it with --stream for progress per step)", file=sys.stderr)
    with tqdm(total=steps, desc="denoising", unit="step", disable=not streamed) as bar:
        full_steps = []
        progress = dict(cache=args.cache, loras=dict(args.lora), on_step=lambda done, total: bar.update(done - bar.n),
                        on_full_steps=full_steps.append, timeout=args.timeout)
        if sound:
            clip = generate_clip(args.url, args.model, args.prompt, defaults["height"], defaults["width"],
                                 defaults["num_frames"], fps, steps, guidance, args.seed, args.negative_prompt,
                                 read_image(args.image[0]) if args.image else None, **progress)
            frames, audio, sample_rate = clip[0][0], clip[1][0], clip[2]
        elif video:
            frames = generate_video(args.url, args.model, args.prompt, defaults["height"], defaults["width"],
                                    defaults["num_frames"], steps, guidance, args.seed, args.negative_prompt,
                                    args.guidance_2, args.max_sequence_length, fps if "fps" in takes else None,
                                    read_image(args.image[0]) if args.image else None,
                                    last_image=read_image(args.last_image) if args.last_image else None,
                                    **progress)[0]
        else:
            true_cfg = guidance_input == "true_cfg_scale"
            image = generate(args.url, args.model, args.prompt, defaults["height"], defaults["width"], steps,
                             None if true_cfg else guidance, args.seed, args.prompt_2, args.max_sequence_length,
                             negative_prompt=args.negative_prompt, true_cfg_scale=guidance if true_cfg else None,
                             images=[read_image(path) for path in args.image], **progress)[0]
    print(f"{full_steps[0]} of {steps} steps ran the whole transformer")
    if output.suffix.lower() == ".png":
        from PIL import Image  # Pillow (the `pipeline` extra): only this command needs it

        image = frames[0] if video else image
        Image.fromarray(image).save(output, format="PNG")
        print(f"wrote {output} ({image.shape[1]}x{image.shape[0]}) in {time.perf_counter() - start:.2f} s")
    else:
        if output.suffix.lower() == ".npy":
            np.save(output, frames)
        else:
            write_mp4(output, frames, fps, (audio, sample_rate) if sound else None)
        with_sound = f", {audio.shape[1] / sample_rate:.2f} s of sound at {sample_rate} Hz" if sound else ""
        print(f"wrote {output} ({frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]}{with_sound}) in "
              f"{time.perf_counter() - start:.2f} s")
    if args.audio is not None:
        write_wav(args.audio, audio, sample_rate)
        print(f"wrote {args.audio} ({audio.shape[0]} channels, {audio.shape[1]} samples at {sample_rate} Hz)")
    return 0


def read_image(path: Path) -> np.ndarray:
    """An image file's RGB pixels, UINT8 [height, width, 3]."""
    from PIL import Image  # Pillow (the `pipeline` extra)

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def write_mp4(path: Path, frames: np.ndarray, fps: float, sound: tuple[np.ndarray, int] | None = None) -> None:
    """frames (UINT8 [frames, height, width, 3]) as an H.264 MP4 (yuv420p, which every player takes) through PyAV;
    with sound (FP32 [channels, samples] in [-1, 1], sample rate), an AAC track beside it."""
    import av  # PyAV (the `video` extra), FFmpeg inside its wheel: only this command needs it

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        if sound is not None:  # every stream is added before the first packet is written
            samples, sample_rate = sound
            layout = "mono" if samples.shape[0] == 1 else "stereo"
            track = container.add_stream("aac", rate=sample_rate, layout=layout)
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if sound is not None:
            audio = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype=np.float32), format="fltp",
                                               layout=layout)
            audio.sample_rate = sample_rate
            container.mux(track.encode(audio))  # PyAV cuts the samples into the encoder's frames
            container.mux(track.encode())


def write_wav(path: Path, samples: np.ndarray, sample_rate: int) -> None:
    """Sound (FP32 [channels, samples] in [-1, 1]) as a 16-bit PCM WAV file."""
    import wave

    pcm = (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2")
    with wave.open(str(path), "wb") as file:
        file.setnchannels(samples.shape[0])
        file.setsampwidth(2)
        file.setframerate(sample_rate)
        file.writeframes(pcm.T.tobytes())


def health(args: argparse.Namespace) -> int:
    with connect(args) as client:
        state = client.health()
        version = client.server_metadata().get("version", "?")
        print(f"server {args.url}: {'live' if state['live'] else 'NOT live'}, "
              f"{'ready' if state['ready'] else 'NOT ready'} (Triton {version})")
        ready = state["ready"]
        if args.model:
            model_ready = client.model_ready(args.model, args.model_version)
            label = args.model + (f" version {args.model_version}" if args.model_version else "")
            print(f"model {label}: {'ready' if model_ready else 'NOT ready'}")
            ready = ready and model_ready
    return 0 if ready else 1


def describe_policy(policy: dict) -> str:
    if "all" in policy:
        return "all versions"
    if "specific" in policy:
        return "versions " + ", ".join(str(v) for v in policy["specific"].get("versions", []))
    return f"latest {policy.get('latest', {}).get('num_versions', 1)}"


def metadata(args: argparse.Namespace) -> int:
    with connect(args) as client:
        info = client.metadata(args.model, args.model_version)
        config = client.model_config(args.model, args.model_version)
    parameters = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
    print(f"model {info['name']} ({info.get('platform', config.get('backend'))}), "
          f"versions served: {', '.join(info.get('versions', []))}; version policy: "
          f"{describe_policy(config.get('version_policy', {}))}")
    print(f"  architecture {parameters.pop('architecture', '?')}, {parameters.pop('data_type', '?')}, "
          f"parallel plan: {parameters.pop('parallel_plan', '?')}")
    for group in config.get("instance_group", []):
        gpus = f" on GPUs {group['gpus']}" if group.get("gpus") else ""
        print(f"  ranks: instance group {group.get('name')!r}, {group.get('kind')}, count {group.get('count', 1)}{gpus}")
    for kind in ("inputs", "outputs"):
        print(f"  {kind}:")
        for spec in info.get(kind, []):
            print(f"    {spec['name']:<24} {spec['datatype']:<5} [{', '.join(spec['shape'])}]")
    if config.get("model_warmup"):
        print(f"  warm-up: {', '.join(w['name'] for w in config['model_warmup'])}")
    print("  parameters: " + " ".join(f"{key}={value}" for key, value in sorted(parameters.items())))
    return 0


def models(args: argparse.Namespace) -> int:
    with connect(args) as client:
        index = client.repository_index()
    rows = [(entry["name"], entry.get("version", "-"), entry.get("state", "-"), entry.get("reason", ""))
            for entry in index]
    widths = [max(len(row[i]) for row in rows + [("MODEL", "VERSION", "STATE", "")]) for i in range(3)]
    for row in [("MODEL", "VERSION", "STATE", "REASON")] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3])
    return 0


def load(args: argparse.Namespace) -> int:
    versions = [int(v) for v in args.versions.split(",")] if args.versions else None
    with connect(args) as client:
        client.load(args.model, versions)
        served = sorted(int(e["version"]) for e in client.repository_index()
                        if e["name"] == args.model and e.get("state") == "READY" and e.get("version"))
    print(f"loaded {args.model}; versions ready: {', '.join(map(str, served)) or 'none'}")
    return 0


def unload(args: argparse.Namespace) -> int:
    with connect(args) as client:
        client.unload(args.model)
    print(f"unloaded {args.model}")
    return 0
