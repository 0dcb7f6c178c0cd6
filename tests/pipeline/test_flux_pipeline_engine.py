"""The pipeline engine in one process (one rank): the image equals diffusers' FluxPipeline with the same
components, and each step is reported as it finishes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import RandomWeights, full_shapes
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.cli import main
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG
from mdtriton.engine.job_control import JobControl, controlled_by
from mdtriton.pipeline.engine import PipelineEngine
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.serving import load_engine
from tests.pipeline.pipelines import max_level_difference, mean_level_difference, reference_image, save_pipelines


def load_pipeline(engine_dir) -> PipelineEngine:
    engine = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single())
    assert isinstance(engine, PipelineEngine)
    return engine


def build_pipeline(repository, name, pipeline_dir, data_type="FP32", **options):
    return build_model_version(repository, name, BuildRequest(
        "flux-pipeline", None, ParallelPlan(), data_type, "cpu", weights_path=pipeline_dir, progress=False, **options))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_engine")
    pipelines = save_pipelines(root)
    built = {}
    for layout, pipeline_dir in pipelines.items():
        version_dir = build_pipeline(root / "repository", layout, pipeline_dir)
        built[layout] = (load_pipeline(version_dir / ENGINE_DIR), pipeline_dir)
    return built


def request(prompts, height, width, steps, guidance, seed, **optional) -> dict[str, torch.Tensor]:
    inputs = {"prompt": torch.from_numpy(prompt_tensor(prompts)), "height": torch.tensor([height], dtype=torch.int32),
              "width": torch.tensor([width], dtype=torch.int32),
              "num_inference_steps": torch.tensor([steps], dtype=torch.int32),
              "guidance_scale": torch.tensor([guidance]), "seed": torch.tensor([seed])}
    if "prompt_2" in optional:
        inputs["prompt_2"] = torch.from_numpy(prompt_tensor(optional["prompt_2"]))
    if "max_sequence_length" in optional:
        inputs["max_sequence_length"] = torch.tensor([optional["max_sequence_length"]], dtype=torch.int32)
    return inputs


@pytest.mark.parametrize("layout", ["dev", "schnell"])
def test_one_rank_image_equals_diffusers_and_reports_each_step(engines, layout):
    engine, pipeline_dir = engines[layout]
    prompts, size, steps, guidance, seed = ["a red cat with a sign", "the blue dog"], (48, 80), 3, 3.5, 7
    reported = []
    with controlled_by(JobControl(on_progress=lambda done, total: reported.append((done, total)))):
        image = engine.forward(request(prompts, *size, steps, guidance, seed))["image"].numpy()
    expected = reference_image(pipeline_dir, prompts, *size, steps, guidance, seed)
    # Our transformer sums the single blocks' output projection in another order than diffusers (two GEMMs, one
    # per input part), so a pixel on a rounding edge may move by one level: the bar the served images have too.
    assert max_level_difference(image, expected) <= 1
    assert 0.2 < (image > 0).mean() and image.std() > 10  # a real picture, not a blank or saturated one
    assert reported == [(1, steps), (2, steps), (3, steps)]


def test_a_bf16_pipeline_is_as_close_to_float32_as_diffusers_in_bf16(engines, tmp_path):
    """Our bf16 transformer rounds in another order than diffusers' (the single blocks' output projection as two
    GEMMs), so its image is not diffusers' bf16 image (up to 9 levels apart, seeds 2-4), but it is as close to the
    float32 image: mean differences 0.90 / 0.86 / 0.98 levels against diffusers' 0.90 / 0.86 / 1.00."""
    _, pipeline_dir = engines["dev"]
    version_dir = build_pipeline(tmp_path, "bf16", pipeline_dir, "BF16")
    engine = load_pipeline(version_dir / ENGINE_DIR)
    image = engine.forward(request(["a cat"], 64, 64, 3, 3.5, 2))["image"].numpy()
    exact = reference_image(pipeline_dir, ["a cat"], 64, 64, 3, 3.5, 2)
    diffusers_bf16 = reference_image(pipeline_dir, ["a cat"], 64, 64, 3, 3.5, 2, dtype=torch.bfloat16)
    assert 0 < mean_level_difference(image, exact) <= 1.1 * mean_level_difference(diffusers_bf16, exact)


def test_verify_checks_the_transformer_rank_files(engines, tmp_path, capsys):
    _, pipeline_dir = engines["dev"]
    version_dir = build_pipeline(tmp_path, "v", pipeline_dir)
    assert main(["verify", str(version_dir)]) == 0
    rank_file = version_dir / ENGINE_DIR / "transformer" / "shard0.safetensors"
    assert capsys.readouterr().out.split() == ["ok", str(rank_file)]


def test_prompt_2_and_sequence_length_reach_the_encoders(engines):
    engine, pipeline_dir = engines["dev"]
    options = {"prompt_2": ["hello world"], "max_sequence_length": 16}
    image = engine.forward(request(["a cat"], 32, 32, 2, 2.0, 3, **options))["image"].numpy()
    assert max_level_difference(image, reference_image(pipeline_dir, ["a cat"], 32, 32, 2, 2.0, 3, **options)) == 0
    without = engine.forward(request(["a cat"], 32, 32, 2, 2.0, 3))["image"].numpy()
    assert not np.array_equal(image, without)


def test_random_transformer_weights_for_a_directory_without_them(engines, tmp_path):
    """The benchmark's build: the directory's transformer/ holds only its config; the weights are random."""
    _, pipeline_dir = engines["dev"]
    shutil.copytree(pipeline_dir, tmp_path / "no_weights")
    for weights in (tmp_path / "no_weights" / "transformer").glob("*.safetensors"):
        weights.unlink()
    config = json.loads((pipeline_dir / "transformer" / "config.json").read_text())
    source = RandomWeights(full_shapes("flux", {key: config[key] for key in FLUX_DEV_CONFIG}), seed=4)
    version_dir = build_pipeline(tmp_path / "repository", "random", tmp_path / "no_weights", seed=4,
                                 random_transformer=True)
    engine = load_pipeline(version_dir / ENGINE_DIR)
    image = engine.forward(request(["a cat"], 32, 32, 2, 3.5, 1))["image"].numpy()

    reference = FluxPipeline.from_pretrained(pipeline_dir, local_files_only=True)
    reference.transformer.load_state_dict({name: source.read(name) for name in source.shapes})
    reference.set_progress_bar_config(disable=True)
    expected = reference(["a cat"], height=32, width=32, num_inference_steps=2, guidance_scale=3.5,
                         generator=torch.Generator().manual_seed(1), output_type="np").images
    assert max_level_difference(image, (expected * 255).round().astype(np.uint8)) == 0
    assert max_level_difference(image, reference_image(pipeline_dir, ["a cat"], 32, 32, 2, 3.5, 1)) > 0
