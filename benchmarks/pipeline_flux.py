"""Prompt to image on one GPU: our FLUX pipeline engine against diffusers' FluxPipeline, same components.

Every component has random weights and FLUX.1-dev's configs (T5-XXL, CLIP-L, the 16-channel VAE, the 11.9 B
transformer), created on the GPU; the tokenizers are small local ones (token ids do not change the work: T5
always gets max_sequence_length tokens, CLIP 77). The transformer's random bf16 weights are built into our
engine format (a model repository under --workdir: 24 GB for FLUX.1-dev's transformer, 10 GB for the other
components, which are also saved once to make the pipeline directory it is built from) and loaded by parameter name into
diffusers' FluxTransformer2DModel, so every row computes with the same weights. Rows:

- mdtriton served, unary and streamed: the pipeline built into a model repository (`build_model_version`, the
  transformer's random weights generated on the device: a unary model, the default), and the same version served as
  a second model built as `--stream` makes it (decoupled: a progress response per step over a gRPC stream), each
  served alone by Triton on one rank and called with `mdtriton.client.pipeline.generate` (unary gRPC infer, or the
  stream); its memory is the GPU memory in use after its images, as seen from outside the server (not a peak);
- mdtriton in-process: the same model version loaded in this process as a served rank loads it (`load_engine`: the
  components from the engine directory, then the transformer engine), and its `forward` (what the served rank runs
  per request: prompt decoding, FluxPipeline with our transformer engine, the UINT8 image);
- diffusers eager: FluxPipeline with diffusers' FluxTransformer2DModel;
- diffusers compiled: the same with `torch.compile` of its transformer (first call, compile included, reported
  apart).

Each row: the median time per image over --repeats after one warm-up image, and the peak GPU memory during its
images (the shared encoders and VAE plus that row's transformer; the pipelines are measured one after another,
each transformer freed before the next is loaded). Below the table, the mdtriton image's parts timed alone
(text encoding, each transformer step, VAE decode) and what the server-side loop costs beyond their sum (the
issue's bound: under 3%), in-process and served.

    python benchmarks/pipeline_flux.py                  # FLUX.1-dev size, 1024x1024, 28 steps, on cuda:0
    python benchmarks/pipeline_flux.py --tiny           # tiny components on the CPU: checks the script

Needs diffusers, transformers and tokenizers (`pip install ".[pipeline]"`) and, for the served row, the server
(`nvidia-pytriton`, see the README); run from the checkout's root (it borrows the tests' local tokenizers).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mdtriton.build_tools.build import build_model_version  # noqa: E402
from mdtriton.build_tools.model_config import read_model_config, write_model_config  # noqa: E402
from mdtriton.build_tools.repository import ENGINE_DIR  # noqa: E402
from mdtriton.client.pipeline import generate  # noqa: E402
from mdtriton.engine.comm import Communicator  # noqa: E402
from mdtriton.engine.manifest import EngineLimits, Manifest  # noqa: E402
from mdtriton.engine.plan import ParallelPlan  # noqa: E402
from mdtriton.serving import load_engine  # noqa: E402
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG  # noqa: E402
from mdtriton.harness import markdown_table, save_pipeline_dir, time_calls  # noqa: E402
from mdtriton.pipeline.prompts import prompt_tensor  # noqa: E402
from mdtriton.server import TritonServer  # noqa: E402
from tests.pipeline.tiny_flux_pipeline import clip_tokenizer, t5_tokenizer, tiny_flux_pipeline  # noqa: E402

PROMPT = "a photo of a cat holding a sign that says hello world"
# FLUX.1-dev's components (their config.json files), T5 = google/t5-v1_1-xxl's encoder, CLIP = ViT-L/14's text model.
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, bos_token_id=0, eos_token_id=2)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              layer_norm_epsilon=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False)
FLUX_DEV_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                          max_image_seq_len=4096)


def flux_dev_components(device: torch.device, dtype: torch.dtype) -> dict:
    """FLUX.1-dev's components but the transformer, random weights made on device (local tokenizers)."""
    with torch.device(device):
        text_encoder = CLIPTextModel(CLIPTextConfig(**CLIP_L)).to(dtype)
        text_encoder_2 = T5EncoderModel(T5Config(**T5_XXL)).to(dtype)
        vae = AutoencoderKL(**FLUX_VAE).to(dtype)
    return {"text_encoder": text_encoder.eval(), "text_encoder_2": text_encoder_2.eval(), "vae": vae.eval(),
            "tokenizer": clip_tokenizer(), "tokenizer_2": t5_tokenizer()}


def tiny_components() -> tuple[dict, dict]:
    """The tests' tiny pipeline's components but the transformer, and the transformer's config."""
    pipeline = tiny_flux_pipeline()
    components = {name: getattr(pipeline, name) for name in ("text_encoder", "text_encoder_2", "vae", "tokenizer",
                                                             "tokenizer_2")}
    return components, {key: pipeline.transformer.config[key] for key in FLUX_DEV_CONFIG}


def scheduler(schedule: dict) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(**schedule)


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
        return pipeline.encode_prompt(PROMPT, None, device=device, max_sequence_length=args.max_sequence_length)

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


def save_flux_pipeline_dir(directory: Path, components: dict, config: dict) -> Path:
    """A diffusers FLUX directory of the components and FLUX.1-dev's scheduler, whose transformer/ holds only its
    config (random weights)."""
    return save_pipeline_dir(directory, {"_class_name": "FluxPipeline",
                                                 "transformer": ["diffusers", "FluxTransformer2DModel"]},
                                     {"scheduler": scheduler(FLUX_DEV_SCHEDULER), **components}, config)


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
        with TritonServer(version_dir.parent.parent, model_control_mode="explicit", load_models=(model,),
                          log_file=version_dir.parent.parent.parent / "server.log") as server:
            def image():
                return generate(server.grpc_address, model, PROMPT, args.height, args.width, args.steps, 3.5, 0,
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
    parser.add_argument("--tiny", action="store_true", help="tiny components on the CPU (checks the script)")
    parser.add_argument("--height", type=int, help="pixels (default 1024; --tiny: 64)")
    parser.add_argument("--width", type=int, help="pixels (default 1024; --tiny: 64)")
    parser.add_argument("--steps", type=int, help="denoising steps (default 28; --tiny: 3)")
    parser.add_argument("--max-sequence-length", type=int, default=512, help="T5 tokens (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="timed images per row, after a warm-up (default 3)")
    parser.add_argument("--no-served", action="store_true", help="leave out the row served by Triton")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile row")
    parser.add_argument("--workdir", type=Path, help="where the pipeline directory and the model repository are "
                                                     "written (default: a temporary directory; FLUX.1-dev size "
                                                     "needs 45 GB of disk)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda:0")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    data_type = "FP32" if args.tiny else "BF16"
    args.height = args.height or (64 if args.tiny else 1024)
    args.width = args.width or (64 if args.tiny else 1024)
    args.steps = args.steps or (3 if args.tiny else 28)

    if args.tiny:
        components, config = tiny_components()
    else:
        components, config = flux_dev_components(device, dtype), dict(FLUX_DEV_CONFIG)
    with tempfile.TemporaryDirectory(prefix="pipeline-flux-") as scratch:
        rows, parts = measure(args, components, config, device, dtype, data_type, args.workdir or Path(scratch))
    report(args, rows, parts, device, data_type)
    return 0


def measure(args, components: dict, config: dict, device: torch.device, dtype: torch.dtype, data_type: str,
            workdir: Path) -> tuple[list, dict]:
    """The table's rows (label, repeat times, first time, GiB) and the parts of our image."""
    start = time.perf_counter()
    pipeline_dir = save_flux_pipeline_dir(workdir / "pipeline", components, config)
    version_dir = build_model_version(
        workdir / "repository", "flux", "flux-pipeline", None, ParallelPlan(), data_type, "cpu" if args.tiny else "gpu",
        weights_path=pipeline_dir, limits=EngineLimits(max_tokens=1 << 20), random_transformer=True,
        random_device=device.type)
    print(f"built the pipeline in {time.perf_counter() - start:.1f} s ({version_dir})", flush=True)
    rows = []
    for name in ("text_encoder", "text_encoder_2", "vae"):  # the GPU to the server and our engine while they run
        components[name].to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_served:
        rows += served_rows(args, version_dir, device)

    # Loaded as a served rank loads it: the components from the engine directory, then the transformer engine.
    engine_dir = version_dir / ENGINE_DIR
    in_process = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single(device))
    request = {"prompt": torch.from_numpy(prompt_tensor([PROMPT])), "height": torch.tensor([args.height]),
               "width": torch.tensor([args.width]), "num_inference_steps": torch.tensor([args.steps]),
               "guidance_scale": torch.tensor([3.5]), "seed": torch.tensor([0]),
               "max_sequence_length": torch.tensor([args.max_sequence_length])}
    times, first, peak = timed(lambda: in_process.forward(request), device, args.repeats)
    rows.append(("mdtriton pipeline engine (1 rank, in-process)", times, first, peak))
    parts = parts_of_our_image(in_process.pipeline, args, device)
    transformer_dir = engine_dir / "transformer"
    weights = load_file(Manifest.read(transformer_dir).weight_file(transformer_dir, 0), device=str(device))
    del in_process
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for name in ("text_encoder", "text_encoder_2", "vae"):
        components[name].to(device)

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**config)
    transformer.load_state_dict(weights, assign=True)
    del weights
    transformer = transformer.to(device=device, dtype=dtype).eval()
    reference = FluxPipeline(scheduler=scheduler(FLUX_DEV_SCHEDULER), transformer=transformer, **components)
    reference.set_progress_bar_config(disable=True)

    def diffusers_image():
        return reference(PROMPT, height=args.height, width=args.width, num_inference_steps=args.steps,
                         guidance_scale=3.5, generator=torch.Generator().manual_seed(0),
                         max_sequence_length=args.max_sequence_length, output_type="np").images

    times, first, peak = timed(diffusers_image, device, args.repeats)
    rows.append(("diffusers FluxPipeline, eager", times, first, peak))
    if not args.no_compile and not args.tiny:
        reference.transformer = torch.compile(transformer)
        times, first, peak = timed(diffusers_image, device, args.repeats)
        rows.append(("diffusers FluxPipeline, torch.compile(transformer)", times, first, peak))
    return rows, parts


def report(args, rows: list, parts: dict, device: torch.device, data_type: str) -> None:
    name = "tiny" if args.tiny else "FLUX.1-dev size"
    where = "CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"\n{name}, {args.height}x{args.width}, {args.steps} steps, {args.max_sequence_length} T5 tokens, "
          f"{data_type}, batch 1, {where}, torch {torch.__version__}; median of {args.repeats} images after a warm-up\n")
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
