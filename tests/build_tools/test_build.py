"""Build tools: engine files, manifest checks, config.pbtxt from Triton's schema, repository versions."""

from __future__ import annotations

import json

import pytest
import torch
from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.build_tools.model_config import read_model_config
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.cli import main
from mdtriton.engine.manifest import EngineError, EngineLimits, Manifest
from mdtriton.engine.plan import ParallelPlan

CONFIG = {"hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "num_layers": 1}


def build(repository, **kwargs):
    options = dict(name="m", architecture_name="tiny_transformer", config=CONFIG, plan=ParallelPlan(tp_size=2),
                   data_type="FP32", device="cpu", progress=False)
    return build_model_version(repository, **{**options, **kwargs})


def test_version_layout_and_config(tmp_path):
    version_dir = build(tmp_path)
    assert version_dir == tmp_path / "m" / "1"
    assert sorted(p.name for p in (version_dir / "engine").iterdir()) == ["manifest.json", "rank0.safetensors",
                                                                        "rank1.safetensors"]
    assert (version_dir / "model.py").read_text().count("class TritonPythonModel") == 1
    config = read_model_config(tmp_path / "m" / "config.pbtxt")
    assert config.backend == "python" and config.max_batch_size == 0
    group = config.instance_group[0]
    assert (group.name, group.kind, group.count) == ("rank", mc.ModelInstanceGroup.KIND_CPU, 2)
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("hidden_states", mc.TYPE_FP32, [-1, -1, 32])]
    assert config.parameters["engine_dir"].string_value == "engine"


def test_gpu_config_lists_one_gpu_per_rank(tmp_path):
    build(tmp_path, device="gpu", gpus=[2, 3])
    group = read_model_config(tmp_path / "m" / "config.pbtxt").instance_group[0]
    assert (group.kind, group.count, list(group.gpus)) == (mc.ModelInstanceGroup.KIND_GPU, 1, [2, 3])
    with pytest.raises(ValueError, match="give 2 distinct GPUs"):
        build(tmp_path, name="other", device="gpu", gpus=[0])


def test_next_versions_and_no_overwrite(tmp_path):
    assert build(tmp_path).name == "1"
    assert build(tmp_path, seed=1).name == "2"
    with pytest.raises(FileExistsError, match="next free: 3"):
        build(tmp_path, version=2)
    with pytest.raises(ValueError, match="share config.pbtxt"):
        build(tmp_path, plan=ParallelPlan(tp_size=4))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1", "2", "config.pbtxt"]


def test_bad_plan_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="num_heads 4 does not divide by tp_size 3"):
        build(tmp_path, plan=ParallelPlan(tp_size=3))
    assert not (tmp_path / "m").exists()


def test_single_rank_engine_loads_and_matches_reference(tmp_path):
    version_dir = build(tmp_path, plan=ParallelPlan(), seed=4)
    engine = TorchEngine.load(version_dir / "engine", Communicator.single())
    x = torch.randn(1, 5, 32)
    expected = reference_module("tiny_transformer", CONFIG, random_weights("tiny_transformer", CONFIG, 4), "FP32")(x)
    assert torch.allclose(engine.forward({"hidden_states": x})["output"], expected["output"], atol=1e-6)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "rank0.safetensors").write_bytes((d / "rank0.safetensors").read_bytes()[:-10]), "truncated"),
    (lambda d: (d / "rank0.safetensors").write_bytes(b"x" * (d / "rank0.safetensors").stat().st_size), "checksum"),
    (lambda d: (d / "rank0.safetensors").unlink(), "missing"),
    (lambda d: (d / "manifest.json").write_text(
        json.dumps({**json.loads((d / "manifest.json").read_text()), "format_version": 99})),
     "format version 99 .* made by a newer mdtriton"),
    (lambda d: (d / "manifest.json").write_text(
        json.dumps({**json.loads((d / "manifest.json").read_text()), "format_version": 1})),
     "format version 1 .* rebuild the engine with this mdtriton"),
    (lambda d: (d / "manifest.json").unlink(), "no engine manifest"),
])
def test_damaged_engine_is_refused_naming_the_file(tmp_path, damage, message):
    engine_dir = build(tmp_path, plan=ParallelPlan()) / "engine"
    damage(engine_dir)
    with pytest.raises(EngineError, match=message) as caught:
        TorchEngine.load(engine_dir, Communicator.single())
    assert str(engine_dir) in str(caught.value)


def test_engine_for_another_plan_is_refused(tmp_path):
    engine_dir = build(tmp_path) / "engine"
    assert Manifest.read(engine_dir).plan.world_size == 2
    with pytest.raises(EngineError, match="built for world 2"):
        TorchEngine.load(engine_dir, Communicator.single())


def test_limits_are_recorded_in_the_manifest(tmp_path):
    assert Manifest.read(build(tmp_path) / "engine").limits == EngineLimits()  # the defaults
    version_dir = build(tmp_path, limits=EngineLimits(max_batch_size=3, max_tokens=100))
    assert Manifest.read(version_dir / "engine").limits == EngineLimits(max_batch_size=3, max_tokens=100)
    assert main(["build", str(tmp_path), "--name", "cli", "--tp", "2", "--max-batch-size", "2",
                 "--max-tokens", "50", "--config", json.dumps(CONFIG)]) == 0
    assert Manifest.read(tmp_path / "cli" / "1" / "engine").limits == EngineLimits(max_batch_size=2, max_tokens=50)
    with pytest.raises(ValueError, match="max_batch_size and max_tokens must be >= 1"):
        EngineLimits(max_batch_size=0)
