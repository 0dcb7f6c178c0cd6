"""The tiny FLUX pipelines of the pipeline tests, their builds, and diffusers' reference images; pipeline engines run
in process on gloo ranks as a server's ranks run them (the plans a test checks without serving them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import FluxPipeline

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.client.pipeline import image_arrays
from mdtriton.engine.comm import Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.serving import check_request, load_engine, with_defaults
from mdtriton.testing.tiny_flux_pipeline import save_tiny_flux_pipeline
from tests.distributed import run_ranks

# FLUX.1-dev's layout (guidance embedding, dynamic shift) and FLUX.1-schnell's (neither).
LAYOUTS = {"dev": True, "schnell": False}


def save_pipelines(root: Path) -> dict[str, Path]:
    """Each layout's tiny pipeline directory, by layout name."""
    return {name: save_tiny_flux_pipeline(root / name, guidance_embeds=guidance, seed=i)
            for i, (name, guidance) in enumerate(LAYOUTS.items())}


def reference_image(pipeline_dir: Path, prompt: list[str], height: int, width: int, steps: int, guidance: float,
                    seed: int, dtype: torch.dtype = torch.float32, **options) -> np.ndarray:
    """diffusers' FluxPipeline with the same components, as UINT8 [batch, height, width, 3]."""
    pipeline = FluxPipeline.from_pretrained(pipeline_dir, local_files_only=True, dtype=dtype)
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator().manual_seed(seed), output_type="np", **options).images
    return (images * 255).round().astype(np.uint8)


def cached_reference_image(pipeline_dir: Path, prompt: list[str], height: int, width: int, steps: int,
                           guidance: float, seed: int, cache) -> tuple[np.ndarray, int]:
    """diffusers' FluxPipeline image after `transformer.enable_cache(cache)` (a diffusers cache config), and how many
    steps ran the whole transformer (its last attention's)."""
    pipeline = FluxPipeline.from_pretrained(pipeline_dir, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.transformer.enable_cache(cache)
    full = []
    pipeline.transformer.single_transformer_blocks[-1].attn.to_q.register_forward_hook(lambda *_: full.append(1))
    images = pipeline(prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator().manual_seed(seed), output_type="np").images
    return (images * 255).round().astype(np.uint8), len(full)


def max_level_difference(image: np.ndarray, reference: np.ndarray) -> int:
    assert image.shape == reference.shape and image.dtype == np.uint8
    return int(np.abs(image.astype(np.int16) - reference.astype(np.int16)).max())


def mean_level_difference(image: np.ndarray, reference: np.ndarray) -> float:
    assert image.shape == reference.shape and image.dtype == np.uint8
    return float(np.abs(image.astype(np.int16) - reference.astype(np.int16)).mean())


def engine_inputs(engine_dir: Path, request: dict) -> dict[str, torch.Tensor]:
    """request (texts as lists, numbers, input images as `images` or by input name) as a server hands it to its ranks:
    tensors typed as the model declares them, checked, with the model's defaults for what it leaves out."""
    manifest = Manifest.read(engine_dir)
    values = {**{key: value for key, value in request.items() if key != "images"},
              **image_arrays(request.get("images", []))}
    inputs = {}
    for spec in manifest.inputs:
        value = values.get(spec.name)
        if value is None:
            continue
        if spec.data_type == "STRING":
            inputs[spec.name] = torch.from_numpy(prompt_tensor(value))
        elif spec.data_type == "UINT8":
            inputs[spec.name] = torch.from_numpy(np.array(value, np.uint8))
        else:
            inputs[spec.name] = torch.tensor([value], dtype=TORCH_DTYPES[spec.data_type])
    check_request(manifest, inputs)
    return with_defaults(manifest, inputs, {})


def outputs_on_rank(rank: int, world_size: int, engines: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    """Each engine (its directory and inputs, by name) loaded on this rank, and its outputs but the step counts."""
    results = {}
    for name, (engine_dir, inputs) in engines.items():
        manifest = Manifest.read(Path(engine_dir))
        comm = Communicator(manifest.plan, rank, torch.device("cpu"))
        comm.join_groups()
        outputs = load_engine(Path(engine_dir), manifest, comm).forward(inputs)
        results[name] = {key: value.numpy() for key, value in outputs.items() if key not in ("step", "full_steps")}
    return results


def outputs_in_process(root: Path, builds: dict[str, tuple[str, Path, ParallelPlan, dict]]) -> list[dict[str, dict]]:
    """Each build (name: architecture, pipeline directory, plan, request) built in root and run on the plans' ranks
    (every plan of one size): the outputs by name, rank by rank."""
    engines = {}
    for name, (architecture, pipeline_dir, plan, request) in builds.items():
        engine_dir = build_model_version(root, name, BuildRequest(
            architecture, None, plan, "FP32", "cpu", weights_path=pipeline_dir, progress=False)) / ENGINE_DIR
        engines[name] = (str(engine_dir), engine_inputs(engine_dir, request))
    world_size = next(iter(builds.values()))[2].world_size
    return run_ranks(world_size, outputs_on_rank, engines, timeout=540)
