"""FLUX test material: random inputs with diffusers' names and random weights; and what every family's engine
tests share: engine directories written with the engine core alone (a manifest and one safetensors file per
tensor-parallel shard), and their run on the ranks of a gloo world."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.layers import shard_state_dict
from mdtriton.engine.manifest import RANK_FILE_KEY, Manifest, WeightFile, file_sha256
from mdtriton.engine.modules import meta_module
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import family
from mdtriton.families.flux.transformer import Flux


def flux_inputs(config: dict, text_len: int, image_len: int, batch: int = 2, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Inputs as the FLUX pipeline makes them: image ids on a (0, row, column) grid; text ids random here
    (zeros in the pipeline) so that a text token's position matters to the test."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(image_len)
    img_ids = torch.stack((torch.zeros(image_len), positions // 4, positions % 4), dim=1).float()
    inputs = {
        "hidden_states": torch.randn(batch, image_len, config["in_channels"], generator=generator, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_len, config["joint_attention_dim"], generator=generator,
                                             dtype=dtype),
        "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=generator, dtype=dtype),
        "timestep": torch.rand(batch, generator=generator, dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": torch.randint(0, 8, (text_len, 3), generator=generator).float(),
    }
    if config["guidance_embeds"]:
        inputs["guidance"] = 1 + 4 * torch.rand(batch, generator=generator, dtype=dtype)
    return inputs


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def fan_in_scaled_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Full float32 weights: matrices ~ N(0, 1/fan_in), norm scales ~ 1 +- 0.2, biases ~ +- 0.1 (non-zero, so a
    bias added on every tensor-parallel rank shows)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Flux(config, Communicator.single()).state_dict().items()}
    weights = {}
    for name, shape in shapes.items():
        values = torch.randn(shape, generator=generator)
        if len(shape) == 2:
            weights[name] = values / math.sqrt(shape[1])
        else:
            weights[name] = 1 + 0.2 * values if "norm" in name else 0.1 * values
    return weights


def write_engine(engine_dir: Path, config: dict, plan: ParallelPlan, weights: dict[str, torch.Tensor],
                 architecture: str = "flux") -> Path:
    """A float32 engine directory of architecture for plan, with each tensor-parallel shard cut from the full
    weights."""
    engine_dir.mkdir(parents=True)
    inputs, outputs = family(architecture).signature(config, "FP32")
    manifest = Manifest(architecture, config, plan, "FP32", inputs, outputs)
    files = []
    for shard in range(plan.tp_size):
        module = meta_module(family(architecture), config, plan, shard)
        path = engine_dir / f"shard{shard}.safetensors"
        save_file(shard_state_dict(module, weights), path, metadata={RANK_FILE_KEY: manifest.file_label(shard)})
        files.append(WeightFile(path.name, path.stat().st_size, file_sha256(path)))
    dataclasses.replace(manifest, weights=tuple(files)).write(engine_dir)
    return engine_dir


def rank_engine(rank: int, engine_dir: str) -> TorchEngine:
    """On one rank of a gloo world: the engine's groups joined (every rank together) and this rank's engine loaded."""
    manifest = Manifest.read(engine_dir)
    comm = Communicator(manifest.plan, rank, torch.device("cpu"))
    comm.join_groups()
    return TorchEngine.load(engine_dir, manifest, family(manifest.architecture), comm)


def run_engines(rank: int, world_size: int, engine_dirs: dict[str, str], cases: list[dict]) -> dict[str, list]:
    """On one rank of a gloo world: load each engine and run every input case; the samples as numpy arrays."""
    results = {}
    for name, engine_dir in engine_dirs.items():
        engine = rank_engine(rank, engine_dir)
        results[name] = [engine.forward(inputs)["sample"].numpy() for inputs in cases]
    return results
