"""Prompt to image on one GPU: our FLUX pipeline engine against diffusers' FluxPipeline, same components.

Every component has random weights and FLUX.1-dev's configs (T5-XXL, CLIP-L, the 16-channel VAE, the 11.9 B
transformer), created on the GPU (mdtriton/testing/random_pipelines.py). The transformer's random bf16 weights are built
into our engine format (a model repository under --workdir: 24 GB for FLUX.1-dev's transformer, 10 GB for the other
components, which are also saved once to make the pipeline directory it is built from) and loaded by parameter name
into diffusers' FluxTransformer2DModel, so every row computes with the same weights. Rows:

- mdtriton served, unary and streamed: the pipeline built into a model repository (the harness's `build_pipeline`:
  `build_model_version`, the transformer's random weights generated on the device: a unary model, the default), and
  the same version served as a second model built as `--stream` makes it (decoupled: a progress response per step
  over a gRPC stream), each served alone by Triton on one rank and called with `mdtriton.client.pipeline.generate`
  (unary gRPC infer, or the stream); its memory is the GPU memory in use after its images, as seen from outside the
  server (not a peak);
- mdtriton in-process: the same model version loaded in this process as a served rank loads it (`load_engine`: the
  components from the engine directory, then the transformer engine), and its `forward` (what the served rank runs
  per request: prompt decoding, FluxPipeline with our transformer engine, the UINT8 image);
- diffusers eager: FluxPipeline loaded from the same pipeline directory, with diffusers' FluxTransformer2DModel;
- diffusers compiled: the same with `torch.compile` of its transformer (first call, compile included, reported
  apart).

Each row: the median time per image over --repeats after one warm-up image, and the peak GPU memory during its
images (the shared encoders and VAE plus that row's transformer; the pipelines are measured one after another,
each transformer freed before the next is loaded). Below the table, the mdtriton image's parts timed alone
(text encoding, each transformer step, VAE decode) and what the server-side loop costs beyond their sum, in-process
and served.

    python benchmarks/pipeline_flux.py                  # FLUX.1-dev size, 1024x1024, 28 steps, on cuda:0
    python benchmarks/pipeline_flux.py --tiny           # tiny components on the CPU: checks the script

Needs diffusers, transformers and tokenizers (`pip install ".[pipeline]"`) and, for the served row, the server
(`nvidia-pytriton`, see the README).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from safetensors.torch import load_file

from mdtriton.build_tools.model_config import read_model_config, write_model_config
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.client.pipeline import generate
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import Manifest
from mdtriton.harness import build_pipeline, device_name, markdown_table, precision, started_server, time_calls
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.serving import load_engine
from mdtriton.testing.random_pipelines import (FLUX_PROMPT, add_pipeline_arguments, flux_pipeline_dir, free_memory,
                                               pipeline_device, work_directory)


def timed(call, device: torch.device, repeats: int, on_this_gpu: bool = True) -> tuple[list[float], float, float]:
    """(seconds of each repeat after one warm-up call, the warm-up's seconds, peak GPU GiB over all calls), by the
    benchmark harness's timer: CUDA events where the call's work runs on this process's GPU (on_this_gpu), else wall
    time (a served image: the server does the work)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    first, _ = time_calls(call, cuda and on_this_gpu, 0, 1)
    times, _ = time_calls(call, cuda and on_this_gpu, 0, repeats)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    return [ms / 1000 for ms in times], first[0] / 1000, peak


def parts_of_our_image(pipeline: FluxPipeline, args, device: torch.device) -> dict[str, float]:
    """Median seconds of the parts of one image, each timed alone: text encoding, one transformer step, VAE decode."""
    def encode():
        return pipeline.encode_prompt(FLUX_PROMPT, None, device=device, max_sequence_length=args.max_sequence_length)

    prompt_embeds, pooled, text_ids = encode()
    latents, image_ids = pipeline.prepare_latents(1, pipeline.transformer.config.in_channels // 4, args.height,
                                                  args.width, prompt_embeds.dtype, device,
                                                  torch.Generator().manual_seed(0))
    guidance = torch.full([1], 3.5, device=device)
    timestep = torch.full([1], 0.5, device=device, dtype=latents.dtype)

    def step():
        return pipeline.transformer(latents, timestep, guidance, pooled, prompt_embeds, text_ids, image_ids)

    unpacked = pipeline._unpack_latents(latents, args.height, args.width, pipeline.vae_scale_factor)

    def decode():
        return pipeline.vae.decode(unpacked / pipeline.vae.config.scaling_factor + pipeline.vae.config.shift_factor)

    with torch.no_grad():
        return {name: statistics.median(timed(call, device, args.repeats)[0])
                for name, call in (("encode", encode), ("step", step), ("decode", decode))}


def served_rows(args, version_dir: Path, device: torch.device) -> list[tuple]:
    """(label, repeat times, first time, GPU GiB in use after the images) of the pipeline served by Triton: the model
    as built (unary), then the same version as a streamed model, each in a server of its own."""
    streamed = version_dir.parent.parent / "flux-stream"
    streamed.mkdir(exist_ok=True)
    if not (streamed / version_dir.name).exists():
        (streamed / version_dir.name).symlink_to(version_dir.resolve())
    config = read_model_config(version_dir.parent / "config.pbtxt")
    config.name = streamed.name
    config.model_transaction_policy.decoupled = True
    write_model_config(streamed / "config.pbtxt", config)
    rows = []
    for model, label in (("flux", "unary gRPC infer"), (streamed.name, "gRPC stream, a response per step")):
        in_use_before = gpu_bytes_in_use(device)
        with started_server(version_dir.parent.parent, version_dir.parent.parent.parent / "server.log",
                            (model,)) as (server, _):
            def image():
                return generate(server.grpc_address, model, FLUX_PROMPT, args.height, args.width, args.steps, 3.5, 0,
                                max_sequence_length=args.max_sequence_length)

            times, first, _ = timed(image, device, args.repeats, on_this_gpu=False)
            in_use = (gpu_bytes_in_use(device) - in_use_before) / 2**30
        rows.append((f"mdtriton served (Triton, 1 rank, {label})", times, first, in_use))
    return rows


def gpu_bytes_in_use(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pipeline_arguments(parser, tiny_steps=3, disk_gb=45)
    parser.add_argument("--max-sequence-length", type=int, default=512, help="T5 tokens (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="timed images per row, after a warm-up (default 3)")
    parser.add_argument("--no-served", action="store_true", help="leave out the row served by Triton")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile row")
    args = parser.parse_args()
    device = pipeline_device(args, tiny_steps=3)
    with work_directory(args) as workdir:
        rows, parts = measure(args, device, workdir)
    report(args, rows, parts, device)
    return 0


def measure(args, device: torch.device, workdir: Path) -> tuple[list, dict]:
    """The table's rows (label, repeat times, first time, GiB) and the parts of our image."""
    dtype, data_type = precision(device)
    start = time.perf_counter()
    pipeline_dir, config = flux_pipeline_dir(workdir / "pipeline", args.tiny, device)
    version_dir = build_pipeline(workdir / "repository", "flux", "flux-pipeline", pipeline_dir, data_type, device)
    print(f"built the pipeline in {time.perf_counter() - start:.1f} s ({version_dir})", flush=True)
    rows = []
    if not args.no_served:
        rows += served_rows(args, version_dir, device)

    # Loaded as a served rank loads it: the components from the engine directory, then the transformer engine.
    engine_dir = version_dir / ENGINE_DIR
    in_process = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single(device))
    request = {"prompt": torch.from_numpy(prompt_tensor([FLUX_PROMPT])), "height": torch.tensor([args.height]),
               "width": torch.tensor([args.width]), "num_inference_steps": torch.tensor([args.steps]),
               "guidance_scale": torch.tensor([3.5]), "seed": torch.tensor([0]),
               "max_sequence_length": torch.tensor([args.max_sequence_length])}
    times, first, peak = timed(lambda: in_process.forward(request), device, args.repeats)
    rows.append(("mdtriton pipeline engine (1 rank, in-process)", times, first, peak))
    parts = parts_of_our_image(in_process.pipeline, args, device)
    transformer_dir = engine_dir / "transformer"
    weights = load_file(Manifest.read(transformer_dir).weight_file(transformer_dir, 0), device=str(device))
    in_process = None
    free_memory()

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**config)
    transformer.load_state_dict(weights, assign=True)
    del weights
    transformer = transformer.to(device=device, dtype=dtype).eval()
    reference = FluxPipeline.from_pretrained(pipeline_dir, transformer=transformer, torch_dtype=dtype,
                                             local_files_only=True).to(device)
    reference.set_progress_bar_config(disable=True)

    def diffusers_image():
        return reference(FLUX_PROMPT, height=args.height, width=args.width, num_inference_steps=args.steps,
                         guidance_scale=3.5, generator=torch.Generator().manual_seed(0),
                         max_sequence_length=args.max_sequence_length, output_type="np").images

    times, first, peak = timed(diffusers_image, device, args.repeats)
    rows.append(("diffusers FluxPipeline, eager", times, first, peak))
    if not args.no_compile and not args.tiny:
        reference.transformer = torch.compile(transformer)
        times, first, peak = timed(diffusers_image, device, args.repeats)
        rows.append(("diffusers FluxPipeline, torch.compile(transformer)", times, first, peak))
    return rows, parts


def report(args, rows: list, parts: dict, device: torch.device) -> None:
    name = "tiny" if args.tiny else "FLUX.1-dev size"
    _, data_type = precision(device)
    print(f"\n{name}, {args.height}x{args.width}, {args.steps} steps, {args.max_sequence_length} T5 tokens, "
          f"{data_type}, batch 1, {device_name(device)}; median of {args.repeats} images after a warm-up\n")
    print(markdown_table(["pipeline", "time per image", "first image", "GPU memory"],
                         [[label, f"{statistics.median(times) * 1000:,.0f} ms", f"{first * 1000:,.0f} ms",
                           f"{memory:.1f} GiB" if device.type == "cuda" else "-"]
                          for label, times, first, memory in rows]))
    parts_sum = parts["encode"] + args.steps * parts["step"] + parts["decode"]
    ours = statistics.median(next(row[1] for row in rows if "in-process" in row[0]))
    print(f"\nmdtriton's parts alone: text encoding {parts['encode'] * 1000:,.1f} ms + {args.steps} x transformer step "
          f"{parts['step'] * 1000:,.1f} ms + VAE decode {parts['decode'] * 1000:,.1f} ms = {parts_sum * 1000:,.0f} ms; "
          f"the whole image in-process {ours * 1000:,.0f} ms: the loop costs {(ours / parts_sum - 1) * 100:+.1f}% "
          "beyond its parts (bound: +3%)")
    for label, times, _, _ in rows:
        if "served" in label:
            served = statistics.median(times)
            print(f"{label}: {served * 1000:,.0f} ms per image, {(served / parts_sum - 1) * 100:+.1f}% beyond the parts "
                  "(the call, the request's check and the image's way back included)")


if __name__ == "__main__":
    sys.exit(main())
