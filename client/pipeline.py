"""Prompt to image (FLUX: `mdtriton build --architecture flux-pipeline`) or to video (Wan: `wan-pipeline`; Cosmos 3:
`cosmos3-pipeline`, also image to video and, with one frame, to an image; LTX-2: `ltx2-pipeline`, a video with its
sound) from a served pipeline model.

A pipeline model answers each request once (unary gRPC infer), unless it was built with `--stream`: then it is
decoupled, each request opens a gRPC stream, and the server sends one response per denoising step (`step`, the steps
done) and then the image. generate() asks the model's config which it is. The stream asks Triton to end with the
request's gRPC status on an error (header triton_grpc_error), so a bad request fails as INVALID_ARGUMENT with the
server's message, as a unary call does; it carries that one request only (with the header, Triton 2.51 crashes when an
error closes a stream that has another request in flight: docs/reliability.md). Every answer says how many of its
steps ran the whole transformer (`full_steps`: fewer with a step cache, the `cache` input). A request may name LoRA
adapters kept with the model (`loras`: `mdtriton lora add`), each with its scale.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mdtriton.client.grpc_client import ClientError, status_of

STREAM_HEADERS = {"triton_grpc_error": "true"}


# The input images a request may carry, in order (mdtriton.pipeline.image_inputs): the first is `image`.
IMAGE_INPUTS = ("image", "image_2", "image_3")
# The data type of each number a pipeline takes (a [1] tensor), as the families' pipelines declare it.
NUMBER_TYPES = {"height": np.int32, "width": np.int32, "num_frames": np.int32, "num_inference_steps": np.int32,
                "guidance_scale": np.float32, "guidance_scale_2": np.float32, "seed": np.int64,
                "max_sequence_length": np.int32, "fps": np.float32, "true_cfg_scale": np.float32,
                "frame_rate": np.float32}


def pipeline_inputs(prompts: list[str], height: int, width: int, num_inference_steps: int,
                    guidance_scale: float | None, seed: int, prompts_2: list[str] | None = None,
                    max_sequence_length: int | None = None, cache: str | dict | None = None,
                    loras: dict[str, float] | None = None, negative_prompts: list[str] | None = None,
                    true_cfg_scale: float | None = None,
                    images: list[np.ndarray] | None = None) -> list[grpcclient.InferInput]:
    """An image pipeline request's inputs (FLUX's; Qwen-Image's negative prompt and true_cfg_scale; input images),
    named and typed as the model declares them (prompts as BYTES; cache, a step cache config: a dict or its JSON text;
    loras, adapter names and scales; images, up to three UINT8 [height, width, 3], sent as image, image_2, image_3);
    those given as None are left out, for the model's default."""
    arrays = request_arrays(
        {"prompt": prompts, "prompt_2": prompts_2, "negative_prompt": negative_prompts},
        {"height": height, "width": width, "num_inference_steps": num_inference_steps, "guidance_scale": guidance_scale,
         "true_cfg_scale": true_cfg_scale, "seed": seed, "max_sequence_length": max_sequence_length}, cache, loras)
    return infer_inputs({**arrays, **image_arrays(images or [])})


def image_arrays(images: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Input images (each UINT8 [height, width, 3]) by input name: image, image_2, image_3 (ValueError for more)."""
    if len(images) > len(IMAGE_INPUTS):
        raise ValueError(f"{len(images)} input images; a request carries at most {len(IMAGE_INPUTS)} "
                         f"({', '.join(IMAGE_INPUTS)})")
    return {name: np.ascontiguousarray(image, dtype=np.uint8) for name, image in zip(IMAGE_INPUTS, images)}


def video_inputs(prompts: list[str], height: int | None, width: int | None, num_frames: int | None,
                 num_inference_steps: int | None, guidance_scale: float | None, seed: int,
                 negative_prompts: list[str] | None = None, guidance_scale_2: float | None = None,
                 max_sequence_length: int | None = None, fps: float | None = None, image: np.ndarray | None = None,
                 cache: str | dict | None = None, loras: dict[str, float] | None = None,
                 last_image: np.ndarray | None = None) -> list[grpcclient.InferInput]:
    """A video pipeline request's inputs (Wan's, Cosmos 3's), named and typed as the model declares them (prompts as
    BYTES; image and last_image UINT8 [height, width, 3]; cache and loras as pipeline_inputs takes them); those given
    as None are left out, for the model's default."""
    arrays = request_arrays(
        {"prompt": prompts, "negative_prompt": negative_prompts},
        {"height": height, "width": width, "num_frames": num_frames, "num_inference_steps": num_inference_steps,
         "guidance_scale": guidance_scale, "seed": seed, "guidance_scale_2": guidance_scale_2,
         "max_sequence_length": max_sequence_length, "fps": fps}, cache, loras)
    for name, picture in (("image", image), ("last_image", last_image)):
        if picture is not None:
            arrays[name] = np.ascontiguousarray(picture, dtype=np.uint8)
    return infer_inputs(arrays)


def request_arrays(prompts: dict[str, list[str] | None], numbers: dict[str, int | float | None],
                   cache: str | dict | None, loras: dict[str, float] | None) -> dict[str, np.ndarray]:
    """A request's arrays by input name: each text input and number given (None: left out, the model's default), and
    the inputs every pipeline takes (with_shared)."""
    arrays = {name: texts(values) for name, values in prompts.items() if values is not None}
    arrays.update({name: np.array([value], NUMBER_TYPES[name]) for name, value in numbers.items() if value is not None})
    return with_shared(arrays, cache, loras)


def with_shared(arrays: dict[str, np.ndarray], cache: str | dict | None,
                loras: dict[str, float] | None) -> dict[str, np.ndarray]:
    """arrays and, if given, the inputs every pipeline takes: `cache` and `loras` (JSON text; the server checks
    them)."""
    if cache is not None:
        arrays = {**arrays, "cache": texts([cache if isinstance(cache, str) else json.dumps(cache)])}
    if loras:
        arrays = {**arrays, "loras": texts([json.dumps(loras)])}
    return arrays


def texts(prompts: list[str]) -> np.ndarray:
    """Prompts as a BYTES tensor [batch] of UTF-8 strings."""
    return np.array([prompt.encode("utf-8") for prompt in prompts], dtype=np.object_)


def infer_inputs(arrays: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def as_list(prompt: str | list[str] | None) -> list[str] | None:
    return [prompt] if isinstance(prompt, str) else None if prompt is None else list(prompt)


def generate(url: str, model: str, prompt: str | list[str], height: int | None = 1024, width: int | None = 1024,
             num_inference_steps: int = 28, guidance_scale: float | None = 3.5, seed: int = 0,
             prompt_2: str | list[str] | None = None, max_sequence_length: int | None = None,
             cache: str | dict | None = None, loras: dict[str, float] | None = None,
             on_step: Callable[[int, int], None] | None = None,
             on_full_steps: Callable[[int], None] | None = None, timeout: float | None = None,
             negative_prompt: str | list[str] | None = None, true_cfg_scale: float | None = None,
             images: list[np.ndarray] | None = None) -> np.ndarray:
    """Images for prompt (one per prompt) as UINT8 [batch, height, width, 3], as the model's diffusers pipeline
    (FluxPipeline, QwenImagePipeline, Flux2Pipeline, FluxKontextPipeline, ...) makes them with
    `generator=torch.Generator().manual_seed(seed)`; on_step(done, total) is called as each step finishes, if the
    model streams its progress (built with --stream).
    Qwen-Image and Qwen-Image-Edit-Plus take negative_prompt and true_cfg_scale, and no guidance_scale (send None).
    images: input images (each UINT8 [height, width, 3] RGB), sent as image, image_2, image_3: the reference images
    of FLUX.2 (none to three), Qwen-Image-Edit-Plus (one to three) and FLUX.1 Kontext (the image to edit: none or one); height and width None: the model's default
    (for these, the input images' size).

    cache: the step cache, e.g. {"method": "first_block", "threshold": 0.08} (docs/client.md; None: the model's
    default). loras: the model's adapters to apply, by name, each with its scale, e.g. {"style": 0.8} (`mdtriton lora
    list` shows them; None: none). on_full_steps(n) gets how many steps ran the whole transformer. timeout: seconds
    the whole request may take (None: no limit). Failures raise ClientError (one line).
    """
    inputs = pipeline_inputs(as_list(prompt), height, width, num_inference_steps, guidance_scale, seed,
                             as_list(prompt_2), max_sequence_length, cache, loras, as_list(negative_prompt),
                             true_cfg_scale, images)
    return ask(url, model, inputs, "image", num_inference_steps, on_step, on_full_steps, timeout)


def generate_video(url: str, model: str, prompt: str | list[str], height: int | None = None,
                   width: int | None = None, num_frames: int | None = None, num_inference_steps: int | None = None,
                   guidance_scale: float | None = None, seed: int = 0, negative_prompt: str | list[str] | None = None,
                   guidance_scale_2: float | None = None, max_sequence_length: int | None = None,
                   fps: float | None = None, image: np.ndarray | None = None, cache: str | dict | None = None,
                   loras: dict[str, float] | None = None, on_step: Callable[[int, int | None], None] | None = None,
                   on_full_steps: Callable[[int], None] | None = None, timeout: float | None = None,
                   last_image: np.ndarray | None = None) -> np.ndarray:
    """Videos for prompt (one per prompt; Cosmos 3 makes one per request) as UINT8 [batch, frames, height, width, 3],
    as the model's diffusers pipeline (WanPipeline, Cosmos3OmniPipeline) makes them with
    `generator=torch.Generator().manual_seed(seed)`; on_step(done, total) is called as each step finishes, if the
    model streams its progress (built with --stream; total is None when num_inference_steps is left to the model).

    Sizes, frames, steps and guidance left as None take the model's defaults (Wan: 480x832, 81 frames, 50 steps,
    5.0; Cosmos 3: 720x1280, 189 frames, 35 steps, 6.0). negative_prompt: one for all prompts or one each (default:
    none). guidance_scale_2: Wan 2.2 A14B's guidance for its low-noise expert (default: guidance_scale). fps (Cosmos
    3): the clip's frame rate, which the model conditions on (default 24). image (Cosmos 3, Wan image to video):
    UINT8 [height, width, 3], the first frame of an image-to-video clip; last_image (Wan 2.2 I2V A14B, Wan 2.1
    FLF2V): its last frame. cache, loras and on_full_steps as generate's (with guidance, the
    count is of the conditional branch's calls). Failures raise ClientError (one line).
    """
    inputs = video_inputs(as_list(prompt), height, width, num_frames, num_inference_steps, guidance_scale, seed,
                          as_list(negative_prompt), guidance_scale_2, max_sequence_length, fps, image, cache, loras,
                          last_image)
    return ask(url, model, inputs, "video", num_inference_steps, on_step, on_full_steps, timeout)


def generate_clip(url: str, model: str, prompt: str | list[str], height: int | None = None, width: int | None = None,
                  num_frames: int | None = None, frame_rate: float | None = None,
                  num_inference_steps: int | None = None, guidance_scale: float | None = None, seed: int = 0,
                  negative_prompt: str | list[str] | None = None, image: np.ndarray | None = None,
                  cache: str | dict | None = None, loras: dict[str, float] | None = None, on_step: Callable[[int, int | None], None] | None = None,
                  on_full_steps: Callable[[int], None] | None = None,
                  timeout: float | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Videos with sound for prompt (LTX-2: one per prompt), as the model's diffusers pipeline (LTX2Pipeline) makes
    them with `generator=torch.Generator().manual_seed(seed)`: (frames UINT8 [batch, frames, height, width, 3], sound
    FP32 [batch, channels, samples] in [-1, 1], the sound's sample rate). frame_rate: the clip's frames per second,
    which sets the sound's length (default 24). What is left as None takes the model's defaults (LTX-2: 512x768, 121
    frames, 30 steps, guidance 3.0); image (LTX2ImageToVideoPipeline): UINT8 [height, width, 3], the clip's first frame;
    negative_prompt, cache, loras, on_step and on_full_steps as generate_video's.
    Failures raise ClientError (one line)."""
    arrays = request_arrays(
        {"prompt": as_list(prompt), "negative_prompt": as_list(negative_prompt)},
        {"height": height, "width": width, "num_frames": num_frames, "frame_rate": frame_rate,
         "num_inference_steps": num_inference_steps, "guidance_scale": guidance_scale, "seed": seed}, cache, loras)
    if image is not None:
        arrays["image"] = np.ascontiguousarray(image, dtype=np.uint8)
    result = answer(url, model, infer_inputs(arrays), "video", num_inference_steps, on_step, on_full_steps, timeout)
    return result.as_numpy("video"), result.as_numpy("audio"), int(result.as_numpy("sample_rate")[0])


def streams_progress(url: str, model: str) -> bool:
    """Whether the model streams a progress response per step (a decoupled model, built with --stream)."""
    client = grpcclient.InferenceServerClient(url)
    try:
        return client.get_model_config(model).config.model_transaction_policy.decoupled
    except InferenceServerException as error:
        raise ClientError(f"generate with {model!r}: {failure(error)}") from None
    finally:
        client.close()


def ask(url: str, model: str, inputs: list[grpcclient.InferInput], output: str, steps: int | None,
        on_step: Callable[[int, int | None], None] | None, on_full_steps: Callable[[int], None] | None,
        timeout: float | None) -> np.ndarray:
    """The output of one request (answer's)."""
    return answer(url, model, inputs, output, steps, on_step, on_full_steps, timeout).as_numpy(output)


def answer(url: str, model: str, inputs: list[grpcclient.InferInput], output: str, steps: int | None,
           on_step: Callable[[int, int | None], None] | None, on_full_steps: Callable[[int], None] | None,
           timeout: float | None) -> grpcclient.InferResult:
    """The answer to one request, holding `output`: over a stream (progress to on_step) if the model streams, else
    one unary call; on_full_steps gets the answer's full_steps."""
    if streams_progress(url, model):
        result = stream(url, model, inputs, output, steps, on_step, timeout)
    else:
        client = grpcclient.InferenceServerClient(url)
        try:
            result = client.infer(model, inputs, client_timeout=timeout)
        except InferenceServerException as error:
            raise ClientError(f"generate with {model!r}: {failure(error)}") from None
        finally:
            client.close()
        if output not in {tensor.name for tensor in result.get_response().outputs}:
            raise ClientError(f"generate with {model!r}: its answer has no {output!r}; is it a pipeline model of that "
                              "kind?")
    if on_full_steps is not None:
        on_full_steps(int(result.as_numpy("full_steps")[0]))
    return result


def stream(url: str, model: str, inputs: list[grpcclient.InferInput], output: str, steps: int | None,
           on_step: Callable[[int, int | None], None] | None, timeout: float | None) -> grpcclient.InferResult:
    """Send one request to a decoupled pipeline model; call on_step with each progress response; return the final
    response (the one holding `output`)."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=timeout,
                            headers=STREAM_HEADERS)
        client.async_stream_infer(model, inputs)
        while True:
            result, error = responses.get()
            if error is not None:
                raise ClientError(f"generate with {model!r}: {failure(error)}")
            names = {tensor.name for tensor in result.get_response().outputs}
            if output in names:
                return result
            if "step" not in names:
                raise ClientError(f"generate with {model!r}: its answer holds {sorted(names)}, no {output!r}; is it "
                                  f"a pipeline model of that kind?")
            if on_step is not None:
                on_step(int(result.as_numpy("step")[0]), steps)
    finally:
        client.stop_stream()
        client.close()


def failure(error: InferenceServerException) -> str:
    """'STATUS: message' in one line."""
    return f"{status_of(error)}: {' '.join(str(error.message()).split())}"
