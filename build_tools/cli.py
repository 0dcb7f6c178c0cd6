"""`mdtriton build`: build an engine and add it to a model repository as a new version."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.engine.manifest import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_TOKENS, EngineLimits
from mdtriton.engine.plan import CFG_SIZES, CP_METHODS, ParallelPlan
from mdtriton.families import (ANY_PIPELINE, PIPELINE_SUFFIX, PipelinePart, architecture_names, diffusers_pipelines,
                               families, family, is_diffusers_pipeline)
from mdtriton.serving import DEFAULT_REQUEST_TIMEOUT_S


def architectures_help() -> str:
    """What each registered architecture builds, for --architecture's help."""
    lines = []
    for name, item in families().items():
        lines.append(f"{name}: {item.description}")
        if item.pipeline is not None:
            lines.append(f"{name}{PIPELINE_SUFFIX}: the whole diffusers {item.pipeline.diffusers_class} (prompt in, "
                         "the denoising loop on the server), from its diffusers directory given by --weights")
        for pipeline_name, part in item.more_pipelines.items():
            lines.append(f"{pipeline_name}: the whole diffusers {part.diffusers_class}, its transformer our {name} "
                         "engine, from its diffusers directory given by --weights")
    for name, part in diffusers_pipelines().items():
        lines.append(f"{name}: the whole diffusers {part.diffusers_class} with diffusers' own transformer, split by "
                     "context parallelism as diffusers declares (--cp; no --tp), from its directory given by --weights")
    lines.append(f"{ANY_PIPELINE}: any other diffusers pipeline, its request read off its call (prompts, sizes, frames, "
                 "steps, guidance, images), with diffusers' own transformer split as diffusers declares (--cp; no "
                 "--tp), from its directory given by --weights")
    return "; ".join(lines)


def max_tokens_help() -> str:
    return ", ".join(f"{name} {item.max_tokens}" for name, item in families().items())


def presets_help() -> str:
    return "; ".join(f"{name}: {', '.join(item.presets())} (default {next(iter(item.presets()))})"
                     for name, item in families().items())


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "build", help="build an engine into MODEL_REPOSITORY/NAME/VERSION",
        description="Build a multi-rank engine (random weights from a seed, or a safetensors checkpoint) and write "
                    "it, with model.py and config.pbtxt, as the next version of a model in a Triton model repository. "
                    "An interrupted build resumes when the same command is run again.")
    parser.add_argument("repository", type=Path, help="model repository directory (created if missing)")
    parser.add_argument("--name", required=True,
                        help="model name: 1 to 100 letters, digits, '.', '_' or '-', starting with a letter or digit")
    parser.add_argument("--version", type=int, help="version number (default: the next free one)")
    parser.add_argument("--architecture", default="tiny_transformer", choices=architecture_names(),
                        help=f"what to build (default tiny_transformer): {architectures_help()}")
    parser.add_argument("--preset", help=f"a named config of the architecture's family: {presets_help()}")
    parser.add_argument("--config", default="{}",
                        help="architecture config as JSON, overriding the preset, or @FILE to read it from a file")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    parser.add_argument("--cp-method", default="allgather_kv", choices=CP_METHODS,
                        help="how attention spans the context-parallel ranks (default allgather_kv); ulysses_ring: "
                             "Ulysses inside groups of --ulysses neighbouring ranks, a ring across the groups")
    parser.add_argument("--ulysses", type=int, default=1,
                        help="Ulysses group size of --cp-method ulysses_ring (dividing --cp; the ring is --cp / this)")
    parser.add_argument("--cfg", type=int, default=1, choices=CFG_SIZES,
                        help="guidance parallelism: 2 runs a guiding pipeline's conditional and unconditional "
                             "transformer calls on two groups of tp x cp ranks at once (wan-pipeline, "
                             "qwen-image-pipeline; default 1)")
    parser.add_argument("--elastic", action="store_true",
                        help="run each request on a group of the ranks instead of all of them: alone, a request takes "
                             "the largest group that makes it faster (by its size and forward times the ranks measure "
                             "at load; config.pbtxt's elastic_min_speedup, default 1.1, says by how much); when "
                             "requests queue, they run at once on groups of 1, 2, 4, ... ranks (each at "
                             "the plan's method, shrunk to the group), so no rank idles while a request waits. For "
                             "plans whose ranks each hold the whole transformer (--cp, --cfg; not --tp), on 2, 4, 8, ... "
                             "ranks")
    parser.add_argument("--dtype", default="FP32", choices=("FP32", "FP16", "BF16", "FP8"),
                        help="engine data type; FP8: the transformer blocks' linear weights in e4m3 with a scale per "
                             "row, activations quantized per token, the rest and the inputs/outputs in BF16 "
                             "(GPUs of compute capability 8.9+: Ada, Hopper, Blackwell)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                        help="instance kind: one KIND_GPU instance per GPU, or KIND_CPU instances (gloo); with gpu, "
                             "on a host with the GPUs, a model whose rank does not fit a GPU's memory is refused, "
                             "naming what a rank holds (its weights; a pipeline's components too) and what to do")
    parser.add_argument("--gpus", help="comma-separated GPU ids for the ranks, in rank order (default 0..N-1)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--seed", type=int, default=0, help="seed for random weights (default 0)")
    weights.add_argument("--weights", type=Path,
                         help="a safetensors checkpoint: one file, a sharded checkpoint's *.safetensors.index.json, or "
                              "a directory with either (diffusers' layout: its config.json fills the config); "
                              "weight names as the architecture's (diffusers' for flux); for a *-pipeline "
                              "architecture, the diffusers pipeline directory (model_index.json, transformer/, vae/, ...)")
    parser.add_argument("--random-device", default="cpu", choices=("cpu", "cuda"),
                        help="where random weights are generated (cuda: much faster for big models; the same seed "
                             "gives other weights than on cpu)")
    parser.add_argument("--request-timeout", type=float,
                        help="seconds (> 0) a request may wait for all ranks before it fails, and the longest a collective "
                             f"may wait for a stopped or stuck rank (default {DEFAULT_REQUEST_TIMEOUT_S:.0f}; a pipeline's: "
                             f"{PipelinePart.request_timeout_s:.0f}, a request being a whole image)")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                        help=f"largest batch a request may carry (default {DEFAULT_MAX_BATCH_SIZE})")
    parser.add_argument("--max-tokens", type=int,
                        help="longest sequence a request may carry, in tokens (FLUX: text + image; Wan: the video's "
                             f"patches); default: the family's ({max_tokens_help()})")
    parser.add_argument("--stream", action="store_true",
                        help="pipeline models: stream a progress response per denoising step, then the result "
                             "(a decoupled model: gRPC streaming only); default: one response per request (unary gRPC "
                             "infer, HTTP/JSON infer, perf_analyzer's default mode)")
    parser.add_argument("--cache", metavar="JSON",
                        help="pipeline models: the step cache of requests that send no `cache` input, e.g. "
                             "'{\"method\": \"first_block\", \"threshold\": 0.08}' (methods: first_block, "
                             "taylorseer, none, those the model offers; docs/client.md); default: none")
    parser.add_argument("--version-policy", metavar="POLICY",
                        help="which versions Triton serves: 'all', 'latest:K' or 'specific:V1,V2,...' "
                             "(default: keep the model's policy; Triton's latest:1 for a new model)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = ParallelPlan(tp_size=args.tp, cp_size=args.cp, cp_method=args.cp_method, cfg_size=args.cfg,
                        ulysses_size=args.ulysses, elastic=args.elastic)
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    default_tokens = (DEFAULT_MAX_TOKENS if is_diffusers_pipeline(args.architecture)
                      else family(args.architecture).max_tokens)
    limits = EngineLimits(args.max_batch_size, args.max_tokens or default_tokens)
    config_text = Path(args.config[1:]).read_text() if args.config.startswith("@") else args.config
    try:
        config = json.loads(config_text)
    except json.JSONDecodeError as error:
        raise SystemExit(f"error: --config is not valid JSON: {error}") from None
    if args.preset and is_diffusers_pipeline(args.architecture):
        raise SystemExit(f"error: {args.architecture} has no presets: it builds from a diffusers directory, "
                         "--weights DIR")
    if args.preset:
        presets = family(args.architecture).presets()
        if args.preset not in presets:
            raise SystemExit(f"error: {args.architecture} has no preset {args.preset!r}; its presets: {', '.join(presets)}")
        config = {**presets[args.preset], **config}
    request = BuildRequest(args.architecture, config, plan, args.dtype, args.device, gpus=gpus, seed=args.seed,
                           weights_path=args.weights, version=args.version, request_timeout_s=args.request_timeout,
                           random_device=args.random_device, policy=args.version_policy, limits=limits,
                           stream=args.stream, cache=args.cache)
    version_dir = build_model_version(args.repository, args.name, request)
    print(f"built {args.architecture} ({plan}, {args.dtype}, {args.device}) into {version_dir}")
    return 0
