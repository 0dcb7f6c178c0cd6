"""LoRA files for the tests, in the formats users bring: diffusers' own (peft keys, as FluxPipeline.save_lora_weights
writes them, with per-module alphas or without) and kohya's (lora_down/lora_up with alphas, BFL module names, q/k/v
joined), all with seeded random factors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

# Factors of this size change the tiny pipeline's image by tens of levels: clearly, without saturating it.
FACTOR_STD = 0.08


def linear_modules(transformer: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in transformer.named_modules() if isinstance(module, nn.Linear)}


def diffusers_lora(path: Path, transformer: nn.Module, seed: int, rank: int, alphas: tuple[float, ...] = ()) -> Path:
    """A LoRA of every linear module of transformer, with diffusers' keys; alphas, if given, are written as network
    alphas (`MODULE.alpha`), cycling over the modules."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index, (name, module) in enumerate(linear_modules(transformer).items()):
        tensors[f"transformer.{name}.lora_A.weight"] = FACTOR_STD * torch.randn(rank, module.in_features,
                                                                                generator=generator)
        tensors[f"transformer.{name}.lora_B.weight"] = FACTOR_STD * torch.randn(module.out_features, rank,
                                                                                generator=generator)
        if alphas:
            tensors[f"transformer.{name}.alpha"] = torch.tensor(alphas[index % len(alphas)])
    save_file(tensors, path)
    return path


def kohya_lora(path: Path, transformer: nn.Module, seed: int, rank: int, alpha: float) -> Path:
    """A kohya (sd-scripts) LoRA of block 0's image q/k/v (joined, as BFL names them), its attention output, its MLP
    and the first single block's output projection, each with an alpha."""
    generator = torch.Generator().manual_seed(seed)
    layers = linear_modules(transformer)
    inner, dim = layers["transformer_blocks.0.attn.to_q"].out_features, layers["x_embedder"].out_features
    shapes = {
        "lora_unet_double_blocks_0_img_attn_qkv": (dim, 3 * inner),
        "lora_unet_double_blocks_0_img_attn_proj": (inner, dim),
        "lora_unet_double_blocks_0_img_mlp_0": (dim, layers["transformer_blocks.0.ff.net.0.proj"].out_features),
        "lora_unet_single_blocks_0_linear2": (layers["single_transformer_blocks.0.proj_out"].in_features, dim),
    }
    tensors = {}
    for key, (in_features, out_features) in shapes.items():
        tensors[f"{key}.lora_down.weight"] = FACTOR_STD * torch.randn(rank, in_features, generator=generator)
        tensors[f"{key}.lora_up.weight"] = 3 * FACTOR_STD * torch.randn(out_features, rank, generator=generator)
        tensors[f"{key}.alpha"] = torch.tensor(alpha)
    save_file(tensors, path)
    return path


def with_adapters(pipeline, files: dict[str, Path], scales: dict[str, float]):
    """A diffusers pipeline with each adapter loaded under its name and set to its scale (diffusers' own way: the
    reference our images must equal), its progress bar off."""
    pipeline.set_progress_bar_config(disable=True)
    for name in scales:
        pipeline.load_lora_weights(str(files[name]), adapter_name=name)
    pipeline.set_adapters(list(scales), list(scales.values()))
    return pipeline


def loras_input(inputs: dict[str, torch.Tensor], scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """A pipeline engine's request inputs with the `loras` input naming these adapters (none: the inputs as they are)."""
    from mdtriton.pipeline.prompts import prompt_tensor

    if not scales:
        return inputs
    return {**inputs, "loras": torch.from_numpy(prompt_tensor([json.dumps(scales)], "loras"))}


def rank_engine(rank: int, engine_dir: str, directory: str):
    """This gloo rank's pipeline engine (tests.distributed.run_ranks has made the process group), whose requests may
    name the adapters in directory."""
    from mdtriton.engine.comm import Communicator
    from mdtriton.engine.manifest import Manifest
    from mdtriton.lora.directory import AdapterSettings
    from mdtriton.serving import load_engine

    manifest = Manifest.read(engine_dir)
    comm = Communicator(manifest.plan, rank, torch.device("cpu"))
    comm.join_groups()
    return load_engine(engine_dir, manifest, comm, AdapterSettings(directory))
