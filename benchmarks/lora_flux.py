"""LoRA adapters per request on one GPU: what an adapter costs a FLUX.1-dev forward and a served image, what switching
costs, and diffusers' peft in the same run.

Random weights of FLUX.1-dev's size; two adapters of rank 64 on every linear layer of the blocks (`a`, `b`), their
factors random at about 1% of the weights. Two parts, one device call each:

- `--part forward`: the transformer engine (random weights, BF16, then FP8) made as the server loads it
  (TorchEngine.from_weights: compiled, CUDA graphs), at 4,096 + 512 tokens: a forward without an adapter, with `a`
  merged (mdtriton.lora.weights), the first merge (the file read, split and moved to the GPU), switching a -> b,
  b -> a, to none and back; whether anything recompiled (after each switch a forward at 4,096 + 512 tokens, which
  replays its CUDA graph, and one at 16,384 + 512, which runs the compiled blocks themselves, under torch.compiler's
  "fail_on_recompile" stance, and Dynamo's graph count compared) or was captured again (the engine's CUDA graphs);
  the memory the merge holds (the base weights' copy, the factors); the output back to the first base output, bit for
  bit. FP8: the adapter's effect against BF16's (relative error of the outputs). Then diffusers'
  FluxTransformer2DModel with the same weights, eager: without an adapter, with `a` loaded by peft (unfused), fusing
  it (`fuse_lora`), fused.
- `--part served`: the BF16 pipeline (every component random, FLUX.1-dev's configs) served by Triton on one rank;
  `a` and `b` added with `mdtriton.lora.repository.add_adapter` while it runs (diffusers-format files); 1024x1024
  images, 28 steps, over unary gRPC: without adapters, with `a` (its first request reads it), again, switched to `b`,
  back to `a`, back to none; how far each image is from the first of its kind (no difference: the merge and the
  base weights put back change nothing else). Then, the server gone, diffusers' FluxPipeline with the served
  transformer's weights, eager: an image without an adapter, with `a` by peft (unfused), `fuse_lora`, fused.

    python benchmarks/lora_flux.py --part forward --workdir /tmp/lora
    python benchmarks/lora_flux.py --part served --workdir /tmp/lora
    python benchmarks/lora_flux.py --part forward --tiny     # FLUX's test config on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
from random_pipelines import FLUX_PROMPT, add_pipeline_arguments, flux_pipeline_dir, pipeline_device, work_directory
from torch import nn

from mdtriton.build_tools.engine_builder import random_shard
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.layers import ParallelLinear
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.modules import meta_module
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG, TINY_CONFIG
from mdtriton.harness import (bench_engine, build_pipeline, device_name, flux_inputs, markdown_table, precision,
                              relative_error, started_server, time_calls)
from mdtriton.lora.adapter_file import Factors, write_adapter
from mdtriton.lora.weights import AdapterWeights

RANK = 64
TEXT_TOKENS, IMAGE_TOKENS = 512, 4096
LONG_IMAGE_TOKENS = 16384  # over GRAPH_MAX_TOKENS: no CUDA graph, the compiled blocks run


def block_linears(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear layer of the blocks, by diffusers' name."""
    model = meta_module(FLUX, config, ParallelPlan(), 0)
    return {name: tuple(layer.weight.shape) for name, layer in model.named_modules()
            if isinstance(layer, (nn.Linear, ParallelLinear)) and name.startswith(("transformer_blocks.",
                                                                                    "single_transformer_blocks."))}


def random_factors(config: dict, seed: int, rank: int, dtype: torch.dtype) -> dict[str, Factors]:
    """Factors whose product is about 1% of a unit-variance-per-input weight."""
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for name, (out_features, in_features) in block_linears(config).items():
        lora_a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
        lora_b = torch.randn(out_features, rank, generator=generator) * (0.01 / math.sqrt(rank))
        factors[name] = Factors(lora_a.to(dtype), lora_b.to(dtype), 1.0)
    return factors


def diffusers_keys(factors: dict[str, Factors]) -> dict[str, torch.Tensor]:
    """The factors under diffusers' keys (as FluxPipeline.save_lora_weights writes them; alpha = rank: scaling 1)."""
    tensors = {}
    for name, module_factors in factors.items():
        tensors[f"transformer.{name}.lora_A.weight"] = module_factors.lora_a
        tensors[f"transformer.{name}.lora_B.weight"] = module_factors.lora_b
    return tensors


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def captured_graphs(engine: TorchEngine) -> int:
    graphs = getattr(engine.run, "graphs", {})
    return sum(len(part.graphs) for part in graphs.values())


def forward_part(args, device: torch.device, workdir: Path) -> None:
    cuda = device.type == "cuda"
    config = dict(TINY_CONFIG if args.tiny else FLUX_DEV_CONFIG)
    dtype, _ = precision(device)
    adapters = workdir / "loras"
    adapters.mkdir(parents=True, exist_ok=True)
    for name, seed in (("a", 1), ("b", 2)):
        write_adapter(adapters / f"{name}.safetensors", random_factors(config, seed, args.rank, dtype))
    inputs = flux_inputs(config, TEXT_TOKENS, IMAGE_TOKENS, device)
    rows, outputs = [], {}
    for data_type in (("FP32",) if args.tiny else ("BF16", "FP8")):
        quantization = "fp8" if data_type == "FP8" else None
        weights = random_shard("flux", config, ParallelPlan(), 0, seed=0, device=device, dtype=dtype,
                               quantization=quantization)
        engine = bench_engine("flux", config, Communicator.single(device), weights,
                              "BF16" if quantization else data_type, quantization)
        merged = AdapterWeights(engine.module, adapters, 4096 * 2**20, dtype)

        def forward():
            return engine.forward(inputs)["sample"]

        def forward_ms() -> float:
            return statistics.median(time_calls(forward, cuda, 2, args.iterations)[0])

        def switch_ms(scales: dict[str, float]) -> float:
            return time_calls(partial(merged.activate, scales), cuda, 0, 1)[0][0]

        base_ms = forward_ms()
        base_output = forward().clone()
        # A request too long for CUDA graphs runs the compiled code itself: after each switch it must not recompile.
        long_inputs = flux_inputs(config, TEXT_TOKENS, LONG_IMAGE_TOKENS, device)
        engine.forward(long_inputs)
        memory_base = torch.cuda.memory_allocated(device) if cuda else 0
        graphs_before, captured_before = dynamo_graphs(), captured_graphs(engine)
        first_merge = switch_ms({"a": 1.0})
        adapted_output = forward().clone()
        memory_merged = torch.cuda.memory_allocated(device) if cuda else 0
        with torch.compiler.set_stance("fail_on_recompile"):
            adapted_ms = forward_ms()
            switches = {"a -> b": [], "b -> a": [], "a -> none": [], "none -> a": []}
            for _ in range(args.switches):
                for label, scales in (("a -> b", {"b": 1.0}), ("b -> a", {"a": 1.0}), ("a -> none", {}),
                                      ("none -> a", {"a": 1.0})):
                    switches[label].append(switch_ms(scales))
                    forward()
                    engine.forward(long_inputs)
            merged.activate({})
            back_to_base = torch.equal(forward(), base_output)
        recompiled = dynamo_graphs() - graphs_before
        recaptured = captured_graphs(engine) - captured_before
        factor_bytes = sum(adapter.bytes for adapter in merged.loaded.values())
        outputs[data_type] = (base_output.float().cpu(), adapted_output.float().cpu())
        rows.append({"data_type": data_type, "base_ms": base_ms, "adapted_ms": adapted_ms,
                     "first_merge_ms": first_merge,
                     "switches": {label: statistics.median(times) for label, times in switches.items()},
                     "recompiled": recompiled, "recaptured": recaptured, "back_to_base": back_to_base,
                     "merged_extra_gib": (memory_merged - memory_base) / 2**30,
                     "factor_mib_each": factor_bytes / len(merged.loaded) / 2**20})
        engine = merged = None  # freed before the next data type's engine is made
        if cuda:
            torch.cuda.empty_cache()

    peft = diffusers_rows(args, config, dtype, device, inputs, adapters)
    report_forward(args, rows, outputs, peft, device)


def diffusers_rows(args, config, dtype, device, inputs, adapters) -> dict[str, float]:
    """diffusers' FluxTransformer2DModel with the BF16 engine's weights (the same seeded random weights, made again),
    eager: ms without an adapter, with `a` by peft (unfused), fusing it, fused."""
    from diffusers import FluxTransformer2DModel

    from mdtriton.lora.adapter_file import read_adapter

    cuda = device.type == "cuda"
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**config)
    transformer.load_state_dict(random_shard("flux", config, ParallelPlan(), 0, seed=0, device=device, dtype=dtype),
                                assign=True)
    transformer = transformer.to(device=device, dtype=dtype).eval()

    def forward_ms() -> float:
        with torch.inference_mode():
            return statistics.median(time_calls(partial(transformer, **inputs), cuda, 2, args.iterations)[0])

    result = {"base_ms": forward_ms()}
    transformer.load_lora_adapter(diffusers_keys(read_adapter(adapters / "a.safetensors")), adapter_name="a")
    result["unfused_ms"] = forward_ms()
    times, _ = time_calls(partial(transformer.fuse_lora, lora_scale=1.0, adapter_names=["a"]), cuda, 0, 1)
    result["fuse_ms"] = times[0]
    result["fused_ms"] = forward_ms()
    return result


def report_forward(args, rows, outputs, peft, device) -> None:
    print(f"\nFLUX.1-dev size (random weights){' (tiny)' if args.tiny else ''}, {IMAGE_TOKENS}+{TEXT_TOKENS} tokens, "
          f"{device_name(device)}; adapters of rank {args.rank} on every linear layer of the blocks "
          f"(median of {args.iterations} forwards; switches: median of {args.switches})\n")
    header = ["engine", "forward", "with `a` merged", "cost", "first merge (read + split + merge)", "a -> b",
              "b -> a", "a -> none", "none -> a", "recompiled / captured again", "base output back exactly",
              "memory while merged"]
    cells = []
    for row in rows:
        switches = row["switches"]
        cells.append([f"mdtriton {row['data_type']}", f"{row['base_ms']:.2f} ms", f"{row['adapted_ms']:.2f} ms",
                      f"{(row['adapted_ms'] / row['base_ms'] - 1) * 100:+.2f}%", f"{row['first_merge_ms']:.0f} ms",
                      *(f"{switches[label]:.1f} ms" for label in ("a -> b", "b -> a", "a -> none", "none -> a")),
                      f"{row['recompiled']} / {row['recaptured']}", row["back_to_base"],
                      f"+{row['merged_extra_gib']:.2f} GiB (factors {row['factor_mib_each']:.0f} MiB each)"])
    cells.append(["diffusers eager, peft", f"{peft['base_ms']:.2f} ms",
                  f"unfused {peft['unfused_ms']:.2f} ms, fused {peft['fused_ms']:.2f} ms",
                  f"{(peft['unfused_ms'] / peft['base_ms'] - 1) * 100:+.2f}% unfused",
                  f"fuse_lora {peft['fuse_ms']:.0f} ms",
                  *[""] * 7])
    print(markdown_table(header, cells))
    if "FP8" in outputs:
        (bf16_base, bf16_adapted), (fp8_base, fp8_adapted) = outputs["BF16"], outputs["FP8"]
        print(f"\nthe adapter's change of the output: BF16 {relative_error(bf16_adapted, bf16_base):.4f}, FP8 "
              f"{relative_error(fp8_adapted, fp8_base):.4f} (relative); FP8 against BF16: without the adapter "
              f"{relative_error(fp8_base, bf16_base):.4f}, with it {relative_error(fp8_adapted, bf16_adapted):.4f}; "
              f"FP8's change against BF16's change: "
              f"{relative_error(fp8_adapted - fp8_base, bf16_adapted - bf16_base):.3f}")


def free_gib(device: torch.device) -> str:
    """The GPU's free memory (the server's worker holds nearly all that is used), as a table cell."""
    return f"{torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB" if device.type == "cuda" else ""


def diffusers_images(args, device: torch.device, pipeline_dir: Path, transformer_dir: Path,
                     workdir: Path) -> list[tuple[str, float, str]]:
    """diffusers' FluxPipeline, eager, with the served transformer's weights, after the server has gone: an image
    without an adapter, with `a` loaded by peft (unfused), `fuse_lora`, with `a` fused; each image after one untimed."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from safetensors.torch import load_file

    dtype, _ = precision(device)
    manifest = Manifest.read(transformer_dir)
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**manifest.config)
    transformer.load_state_dict(load_file(manifest.weight_file(transformer_dir, 0), device=str(device)), assign=True)
    pipeline = FluxPipeline.from_pretrained(pipeline_dir, transformer=transformer.to(dtype), torch_dtype=dtype,
                                            local_files_only=True).to(device)
    pipeline.set_progress_bar_config(disable=True)

    def image_ms() -> float:
        call = partial(pipeline, FLUX_PROMPT, height=args.height, width=args.width, num_inference_steps=args.steps,
                       guidance_scale=3.5, generator=torch.Generator().manual_seed(0), output_type="np")
        return time_calls(call, device.type == "cuda", 1, 1)[0][0]

    rows = [("diffusers FluxPipeline eager, image without an adapter", image_ms(), "")]
    pipeline.load_lora_weights(str(workdir / "a-diffusers.safetensors"), adapter_name="a")
    rows.append(("diffusers FluxPipeline eager, image with a (peft, unfused)", image_ms(), ""))
    fuse_ms = time_calls(partial(pipeline.fuse_lora, lora_scale=1.0, adapter_names=["a"]), device.type == "cuda",
                         0, 1)[0][0]
    rows.append(("diffusers fuse_lora(a)", fuse_ms, ""))
    rows.append(("diffusers FluxPipeline eager, image with a fused", image_ms(), ""))
    return rows


def served_part(args, device: torch.device, workdir: Path) -> None:
    from safetensors.torch import save_file

    from mdtriton.build_tools.adapters import add_adapter
    from mdtriton.client.pipeline import generate

    dtype, data_type = precision(device)
    pipeline_dir, config = flux_pipeline_dir(workdir / "pipeline", args.tiny, device)
    repository = workdir / "repository-served"
    version = build_pipeline(repository, "flux", "flux-pipeline", pipeline_dir, data_type, device)
    rows, images = [], {}  # images by their adapter (None: none)
    with started_server(repository, workdir / "server-lora.log") as (server, _):
        def image(loras):
            call = partial(generate, server.grpc_address, "flux", FLUX_PROMPT, args.height, args.width, args.steps, 3.5,
                           0, loras=loras)
            times, pictures = time_calls(call, False, 0, 1)  # a client call: wall time
            return times[0], pictures[0]

        image(None)  # the ranks meet, the graphs are captured
        for name, seed in (("a", 1), ("b", 2)):
            file = workdir / f"{name}-diffusers.safetensors"
            save_file(diffusers_keys(random_factors(config, seed, args.rank, dtype)), file)
            times, _ = time_calls(partial(add_adapter, repository, "flux", file, name), False, 0, 1)
            rows.append((f"mdtriton lora add {name} (server running)", times[0], free_gib(device)))
        for label, loras in (("none", None), ("none", None), ("a (first: read from the repository)", {"a": 1.0}),
                             ("a", {"a": 1.0}), ("a", {"a": 1.0}), ("switched to b", {"b": 1.0}),
                             ("switched back to a", {"a": 1.0}), ("switched to none", None)):
            elapsed, picture = image(loras)
            images.setdefault(loras and next(iter(loras)), []).append(picture)
            rows.append((f"image, adapters: {label}", elapsed, free_gib(device)))
    rows += diffusers_images(args, device, pipeline_dir, version / ENGINE_DIR / "transformer", workdir)
    print(f"\nFLUX.1-dev pipeline size (random weights){' (tiny)' if args.tiny else ''}, served by Triton on one rank "
          f"({data_type}), unary gRPC, {args.width}x{args.height}, {args.steps} steps, {device_name(device)}; adapters "
          f"of rank {args.rank} on every linear layer of the blocks\n")
    print(markdown_table(["what", "time", "GPU memory free after it"],
                         [[label, f"{elapsed:,.0f} ms", free] for label, elapsed, free in rows]))
    for name, pictures in images.items():
        differences = [int(np.abs(picture.astype(np.int16) - pictures[0]).max()) for picture in pictures[1:]]
        print(f"images with adapters {name or 'none'}: the largest level difference of each later one from the first: "
              f"{differences}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", required=True, choices=("forward", "served"))
    add_pipeline_arguments(parser, tiny_steps=4, disk_gb=40)
    parser.add_argument("--rank", type=int, default=RANK, help=f"the adapters' rank (default {RANK})")
    parser.add_argument("--iterations", type=int, default=20, help="forwards timed (default 20)")
    parser.add_argument("--switches", type=int, default=5, help="switch cycles timed (default 5)")
    args = parser.parse_args()
    device = pipeline_device(args, tiny_steps=4)
    with work_directory(args) as workdir:
        (forward_part if args.part == "forward" else served_part)(args, device, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
