"""Engines built from safetensors checkpoints: diffusers' sharded layout, streamed rank by rank."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file, save_file

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.checkpoint import Checkpoint, CheckpointError
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.layers import shard_state_dict
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.modules import meta_module
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from tests.engine.flux_cases import flux_inputs, max_relative_error

# Not the tiny preset: the build must take these sizes from the checkpoint's config.json.
CONFIG = {**FLUX.default_config(), "num_layers": 1, "num_single_layers": 3, "joint_attention_dim": 40}


@pytest.fixture(scope="module")
def diffusers_checkpoint(tmp_path_factory):
    """A FLUX transformer saved by diffusers in its sharded layout (several files, an index, config.json)."""
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**{**CONFIG, "axes_dims_rope": tuple(CONFIG["axes_dims_rope"])}).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    directory = tmp_path_factory.mktemp("flux-checkpoint")
    model.save_pretrained(directory, max_shard_size="200KB")
    assert len(list(directory.glob("*.safetensors"))) > 1
    return directory, model


def test_sharded_diffusers_checkpoint_builds_each_tp_shard_its_slices_and_every_rank_reads_its_own(tmp_path, diffusers_checkpoint):
    directory, model = diffusers_checkpoint
    plan = ParallelPlan(tp_size=2, cp_size=2, cp_method="ring")
    version_dir = build_model_version(tmp_path, "flux", BuildRequest(
        "flux", None, plan, "FP32", "cpu", weights_path=directory, progress=False))
    full = model.state_dict()
    engine_dir = version_dir / "engine"
    manifest = Manifest.read(engine_dir)
    # One file per tensor-parallel shard: each context-parallel replica reads the file of its tp index.
    assert sorted(path.name for path in engine_dir.glob("*.safetensors")) == ["shard0.safetensors", "shard1.safetensors"]
    for rank in range(plan.world_size):
        expected = shard_state_dict(meta_module(FLUX, CONFIG, plan, rank), full)
        got = load_file(manifest.weight_file(engine_dir, rank))
        assert set(got) == set(expected)
        assert all(torch.equal(got[name], expected[name]) for name in expected), f"rank {rank}"


def test_one_rank_engine_from_checkpoint_matches_diffusers(tmp_path, diffusers_checkpoint):
    directory, model = diffusers_checkpoint
    index = next(directory.glob("*.safetensors.index.json"))
    version_dir = build_model_version(tmp_path, "flux", BuildRequest(
        "flux", None, ParallelPlan(), "FP32", "cpu", weights_path=index, progress=False))
    engine_dir = version_dir / "engine"
    engine = TorchEngine.load(engine_dir, Manifest.read(engine_dir), FLUX, Communicator.single())
    assert engine.manifest.config["num_single_layers"] == 3  # from config.json
    inputs = flux_inputs(CONFIG, text_len=4, image_len=9)
    with torch.inference_mode():
        assert max_relative_error(engine.forward(inputs)["sample"], model(**inputs).sample) < 1e-5


def test_checkpoint_that_does_not_fit_the_config_is_refused_early(tmp_path, diffusers_checkpoint):
    directory, _ = diffusers_checkpoint
    with pytest.raises(CheckpointError, match=r"weights missing.*single_transformer_blocks\.3"):
        build_model_version(tmp_path, "flux", BuildRequest(
            "flux", {"num_single_layers": 4}, ParallelPlan(), "FP32", "cpu", weights_path=directory, progress=False))
    with pytest.raises(CheckpointError, match="of another shape"):
        build_model_version(tmp_path, "flux", BuildRequest(
            "flux", {"joint_attention_dim": 32}, ParallelPlan(), "FP32", "cpu", weights_path=directory, progress=False))
    assert not any((tmp_path / "flux").glob(".building-*"))


def test_unreadable_checkpoints_say_what_is_wrong(tmp_path):
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        Checkpoint(tmp_path / "broken.safetensors")
    save_file({"a": torch.zeros(2)}, tmp_path / "part1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "part1.safetensors", "b": "part2.safetensors"}}))
    with pytest.raises(CheckpointError, match="part2.safetensors: listed in model.safetensors.index.json but missing"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        Checkpoint(tmp_path / "nothing.safetensors")
