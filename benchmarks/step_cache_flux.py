"""Step caching of the FLUX pipeline: First Block Cache and TaylorSeer, served (one GPU, or a plan's GPUs) and against
diffusers (one GPU).

Every component has random weights and FLUX.1-dev's configs (random_pipelines.py makes them). Random weights make
other skip decisions than FLUX.1-dev's, so First Block Cache is measured at a fixed count of full steps (18 of 28 by
default: what threshold 0.08 gives on FLUX.1-dev): the threshold that gives that count on these weights is found by
bisection over served requests (each answer says its `full_steps`). Two parts, one device call each:

- `--part served`: the pipeline built in BF16, then in FP8, each served by Triton on one rank (unary gRPC), or on
  the ranks of `--plan` (served_pipeline.py's plan names: ulysses4, cfg2xulysses2, ...), and asked for the same
  1024x1024 image: uncached, with First Block Cache at the fixed count, and (BF16) TaylorSeer
  (cache_interval 5, disable_cache_before_step 3, max_order 1). Then the FP8 images against the BF16 ones (PSNR).
- `--part in-process`: the BF16 pipeline in this process (our pipeline engine, what a served rank runs) against
  diffusers' FluxPipeline (the same components) with its transformer compiled (`torch.compile`), uncached and with
  diffusers' own First Block Cache (`transformer.enable_cache`) at the threshold given (--threshold: the one `--part
  served` found); the time of a full and of a skipped transformer step through the cache's parts (CUDA graphs, as
  served) and of the decision alone (its sums and their reduction across context-parallel ranks; on one GPU the
  reduction sends nothing).
- `--part decision-cpu`: the decision's cost on 2 CPU ranks (gloo, ring context parallelism, whose ranks add their
  sums) against a transformer step of FLUX's test config at the same tokens.

    python benchmarks/step_cache_flux.py --part served --workdir /tmp/sc
    python benchmarks/step_cache_flux.py --part served --plan ulysses4 --workdir /dev/shm/sc   # on 4 GPUs
    python benchmarks/step_cache_flux.py --part in-process --threshold T --workdir /tmp/sc
    python benchmarks/step_cache_flux.py --part decision-cpu
    python benchmarks/step_cache_flux.py --part served --tiny      # tiny components on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from random_pipelines import (FLUX_PROMPT, add_pipeline_arguments, flux_pipeline_dir, free_memory, pipeline_device,
                              plan_of, work_directory)

from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.client.pipeline import generate
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.step_cache import FirstBlockCache, StepCache, decide
from mdtriton.harness import (bench_engine, build_pipeline, device_name, markdown_table, precision, psnr,
                              started_server, time_calls)
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.serving import load_engine

TAYLORSEER = {"method": "taylorseer", "cache_interval": 5, "disable_cache_before_step": 3, "max_order": 1}


def served_part(args, device: torch.device, workdir: Path) -> None:
    pipeline_dir, _ = flux_pipeline_dir(workdir / "pipeline", args.tiny, device)
    rows, images, thresholds = [], {}, {}
    for data_type in (("FP32", "BF16") if args.tiny else ("BF16", "FP8")):
        repository = workdir / f"repository-{data_type}"
        build_pipeline(repository, "flux", "flux-pipeline", pipeline_dir, data_type, device, plan_of(args.plan))
        with started_server(repository, workdir / f"server-{data_type}.log") as (server, _):
            def image(cache=None):
                """(ms, full steps, the image) of one served image, by the wall clock (the server does the work)."""
                counts = []
                times, picture = time_calls(lambda: generate(server.grpc_address, "flux", FLUX_PROMPT, args.height,
                                                             args.width, args.steps, 3.5, 0, cache=cache,
                                                             on_full_steps=counts.append)[0], False, 0, 1)
                return times[0], counts[0], picture

            def timed(label, cache=None):
                image(cache)  # the first of each kind (a CUDA graph capture for the cache's parts)
                runs = [image(cache) for _ in range(args.repeats)]
                rows.append((data_type, label, [run[0] for run in runs], runs[0][1]))
                return runs[0][2]

            images[data_type, "uncached"] = timed("uncached")
            threshold = full_steps_threshold(image, args.full_steps, args.steps)
            thresholds[data_type] = threshold
            images[data_type, "first_block"] = timed(f"First Block Cache, threshold {threshold:.5f}",
                                                     {"method": "first_block", "threshold": threshold})
            if data_type == "BF16" or args.tiny:
                images[data_type, "taylorseer"] = timed("TaylorSeer (5, 3, None, 1)", TAYLORSEER)
        shutil.rmtree(repository)

    ranks = "one rank" if args.plan == "1" else f"{args.plan} ({plan_of(args.plan)})"
    print(f"\nFLUX.1-dev size (random weights){' (tiny)' if args.tiny else ''}, served by Triton on {ranks}, unary "
          f"gRPC, {args.width}x{args.height}, {args.steps} steps, {device_name(device)}; median of {args.repeats} "
          "images after one\n")
    base = statistics.median(next(row[2] for row in rows if row[1] == "uncached"))
    print(markdown_table(["transformer", "cache", "full steps", "time per image", "against the first row (uncached)"],
                         [[data_type, label, f"{full} of {args.steps}", f"{statistics.median(times):,.0f} ms",
                           f"{statistics.median(times) / base:.3f}x"] for data_type, label, times, full in rows]))
    bf16, fp8 = ("FP32", "BF16") if args.tiny else ("BF16", "FP8")
    for kind in ("uncached", "first_block"):
        print(f"{fp8} image against the {bf16} one, {kind}: PSNR {psnr(images[fp8, kind], images[bf16, kind]):.1f} dB")
    print(f"{bf16} First Block Cache image against the uncached one: PSNR "
          f"{psnr(images[bf16, 'first_block'], images[bf16, 'uncached']):.1f} dB")
    print(f"thresholds giving {args.full_steps} full steps: {json.dumps(thresholds)}")


def full_steps_threshold(image, wanted: int, steps: int) -> float:
    """A First Block Cache threshold at which the served image runs `wanted` full steps (bisection: fewer full steps
    as the threshold grows)."""
    low, high = 0.0, 1.0
    while image({"method": "first_block", "threshold": high})[1] > wanted:
        low, high = high, high * 4
    for _ in range(30):
        middle = (low + high) / 2
        full = image({"method": "first_block", "threshold": middle})[1]
        print(f"threshold {middle:.5f}: {full} of {steps} full steps", flush=True)
        if full == wanted:
            return middle
        low, high = (middle, high) if full > wanted else (low, middle)
    raise SystemExit(f"no threshold gives {wanted} full steps (last tried {middle}: {full})")


def in_process_part(args, device: torch.device, workdir: Path) -> None:
    from diffusers import FirstBlockCacheConfig, FluxPipeline, FluxTransformer2DModel
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook
    from safetensors.torch import load_file

    dtype, data_type = precision(device)
    pipeline_dir, config = flux_pipeline_dir(workdir / "pipeline", args.tiny, device)
    version_dir = build_pipeline(workdir / "repository", "flux", "flux-pipeline", pipeline_dir, data_type, device)
    engine_dir = version_dir / ENGINE_DIR
    comm = Communicator.single(device)
    ours = load_engine(engine_dir, Manifest.read(engine_dir), comm)
    request = {"prompt": torch.from_numpy(prompt_tensor([FLUX_PROMPT])), "height": torch.tensor([args.height]),
               "width": torch.tensor([args.width]), "num_inference_steps": torch.tensor([args.steps]),
               "guidance_scale": torch.tensor([3.5]), "seed": torch.tensor([0])}
    cache = json.dumps({"method": "first_block", "threshold": args.threshold})
    rows = []
    for label, inputs in (("uncached", request),
                          (f"First Block Cache {args.threshold:.5f}",
                           {**request, "cache": torch.from_numpy(prompt_tensor([cache]))})):
        times, full = time_calls(partial(ours.forward, inputs), device.type == "cuda", 1, args.repeats)
        rows.append(("mdtriton pipeline engine (in-process)", label, times, int(full["full_steps"][0])))
    steps = step_parts(ours.transformers[0].engine, ours.pipeline, args, device)
    transformer_file = Manifest.read(engine_dir / "transformer").weight_file(engine_dir / "transformer", 0)
    ours = None
    free_memory()

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**config)
    transformer.load_state_dict(load_file(transformer_file, device=str(device)), assign=True)
    transformer = transformer.to(device=device, dtype=dtype).eval()
    reference = FluxPipeline.from_pretrained(pipeline_dir, transformer=transformer, torch_dtype=dtype,
                                             local_files_only=True).to(device)
    reference.set_progress_bar_config(disable=True)
    # Its decisions, counted where diffusers takes them, outside the compiled graph (a forward hook inside it would
    # make torch.compile recompile).
    decisions = []
    decide_of = FBCHeadBlockHook._should_compute_remaining_blocks
    FBCHeadBlockHook._should_compute_remaining_blocks = lambda hook, residual: record(decide_of(hook, residual))

    def record(decision: bool) -> bool:
        decisions.append(decision)
        return decision

    def diffusers_image():
        decisions.clear()
        return reference(FLUX_PROMPT, height=args.height, width=args.width, num_inference_steps=args.steps,
                         guidance_scale=3.5, generator=torch.Generator().manual_seed(0), output_type="np")

    compiled = "torch.compile(transformer)" if not args.tiny else "eager (--tiny)"
    if not args.tiny:
        reference.transformer = torch.compile(transformer)
    times, _ = time_calls(diffusers_image, device.type == "cuda", 1, args.repeats)
    rows.append((f"diffusers FluxPipeline, {compiled}", "uncached", times, args.steps))
    transformer.enable_cache(FirstBlockCacheConfig(threshold=args.threshold))
    if not args.tiny:  # compiled again, with the cache's hooks in place
        reference.transformer = torch.compile(transformer)
    times, _ = time_calls(diffusers_image, device.type == "cuda", 1, args.repeats)
    rows.append((f"diffusers FluxPipeline, {compiled}", f"its First Block Cache {args.threshold:.5f}", times,
                 sum(decisions)))

    print(f"\nFLUX.1-dev size (random weights){' (tiny)' if args.tiny else ''}, in-process, "
          f"{args.width}x{args.height}, {args.steps} steps, {device_name(device)}; median of {args.repeats} images "
          "after one\n")
    print(markdown_table(["pipeline", "cache", "full steps", "time per image"],
                         [[pipeline, label, f"{count} of {args.steps}", f"{statistics.median(times):,.0f} ms"]
                          for pipeline, label, times, count in rows]))
    print(f"\nour transformer step, through First Block Cache's parts: full {steps['full']:.2f} ms, skipped "
          f"{steps['skipped']:.2f} ms (the uncached forward: {steps['forward']:.2f} ms); the decision alone "
          f"{steps['decision']:.3f} ms ({steps['decision'] / steps['forward'] * 100:.2f}% of a step)")


def step_parts(engine, pipeline, args, device: torch.device) -> dict[str, float]:
    """Median ms of one transformer step at the image's size: the uncached forward, a full and a skipped step through
    First Block Cache's parts (threshold -1: always full; a huge one: skipped after the first), the decision alone."""
    with torch.no_grad():
        prompt_embeds, pooled, text_ids = pipeline.encode_prompt(FLUX_PROMPT, None, device=device)
        latents, image_ids = pipeline.prepare_latents(1, pipeline.transformer.config.in_channels // 4, args.height,
                                                      args.width, prompt_embeds.dtype, device,
                                                      torch.Generator().manual_seed(0))
    inputs = {"hidden_states": latents, "encoder_hidden_states": prompt_embeds, "pooled_projections": pooled,
              "timestep": torch.full([1], 0.5, device=device, dtype=latents.dtype), "img_ids": image_ids.float(),
              "txt_ids": text_ids.float(), "guidance": torch.full([1], 3.5, device=device, dtype=latents.dtype)}

    cuda = device.type == "cuda"

    def step_ms(cache) -> float:
        return statistics.median(time_calls(partial(engine.forward, inputs, cache), cuda, 1, args.step_repeats)[0])

    with torch.inference_mode():
        residual = engine.run(inputs, "first_block")["residual"]
    previous = residual * 1.01

    def decision_ms() -> float:
        call = partial(decide, residual, previous, 0.08, engine.comm)
        return statistics.median(time_calls(call, cuda, 1, args.step_repeats * 10)[0])

    return {"forward": step_ms(None), "full": step_ms(StepCache(FirstBlockCache(threshold=-1.0))),
            "skipped": step_ms(StepCache(FirstBlockCache(threshold=math.inf))), "decision": decision_ms()}


def decision_cpu_part(args) -> None:
    from tests.distributed import run_ranks

    text, image = 512, 4096
    results = run_ranks(2, decision_on_rank, text, image, args.step_repeats)
    step, decision = results[0]
    print(f"\n2 CPU ranks (gloo), ring context parallelism, FLUX test config, {image}+{text} tokens: a transformer "
          f"step {step:.1f} ms, the decision (sums and their all-reduce) {decision:.3f} ms = "
          f"{decision / step * 100:.2f}% of a step")


def decision_on_rank(rank: int, world_size: int, text: int, image: int, repeats: int) -> tuple[float, float]:
    from mdtriton.build_tools.engine_builder import random_shard
    from mdtriton.families import family
    from mdtriton.families.flux.transformer import example_inputs

    flux = family("flux")
    config = flux.default_config()
    comm = Communicator(ParallelPlan(cp_size=2, cp_method="ring"), rank, torch.device("cpu"))
    comm.join_groups()
    engine = bench_engine("flux", config, comm, random_shard("flux", config, comm.plan, rank, seed=0), "FP32")
    inputs = example_inputs(config, text, image, torch.float32)
    step = statistics.median(time_calls(partial(engine.forward, inputs), False, 1, repeats)[0])
    with torch.inference_mode():
        residual = engine.module.first_block(**inputs)["residual"]
        decision = time_calls(partial(decide, residual, residual * 1.01, 0.08, comm), False, 1, repeats * 20)[0]
    return step, statistics.median(decision)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", required=True, choices=("served", "in-process", "decision-cpu"))
    add_pipeline_arguments(parser, tiny_steps=6, disk_gb=45)
    parser.add_argument("--full-steps", type=int, help="First Block Cache's full steps (default 18; --tiny: 4)")
    parser.add_argument("--plan", default="1", help="served: the plan, as served_pipeline.py names plans (default 1)")
    parser.add_argument("--threshold", type=float, help="in-process: the First Block Cache threshold (served found it)")
    parser.add_argument("--repeats", type=int, default=2, help="images timed after the first of each kind (default 2)")
    parser.add_argument("--step-repeats", type=int, default=10, help="transformer steps timed (default 10)")
    args = parser.parse_args()
    device = pipeline_device(args, tiny_steps=6)
    args.full_steps = args.full_steps or (4 if args.tiny else 18)
    if args.part == "decision-cpu":
        decision_cpu_part(args)
        return 0
    if args.part == "in-process" and args.threshold is None:
        parser.error("--part in-process needs --threshold (the one --part served printed)")
    with work_directory(args) as workdir:
        (served_part if args.part == "served" else in_process_part)(args, device, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
