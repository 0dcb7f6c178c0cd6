"""Build tools: engine files, manifest checks, config.pbtxt from Triton's schema, repository versions."""

from __future__ import annotations

import json

import pytest
import torch
from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.build_tools.build import BuildInterrupted, build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import RandomWeights, build_engine, full_shapes, random_weights, reference_module
from mdtriton.build_tools.model_config import read_model_config
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.cli import main
from mdtriton.engine.manifest import EngineError, EngineLimits, Manifest, file_sha256
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.tiny_transformer import TINY_TRANSFORMER

CONFIG = {"hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "num_layers": 1}


def build(repository, name="m", **kwargs):
    options = dict(architecture_name="tiny_transformer", config=CONFIG, plan=ParallelPlan(tp_size=2),
                   data_type="FP32", device="cpu", progress=False)
    return build_model_version(repository, name, BuildRequest(**{**options, **kwargs}))


def test_version_layout_and_config(tmp_path):
    version_dir = build(tmp_path)
    assert version_dir == tmp_path / "m" / "1"
    assert sorted(p.name for p in (version_dir / "engine").iterdir()) == ["manifest.json", "shard0.safetensors",
                                                                        "shard1.safetensors"]
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
    engine = TorchEngine.load(version_dir / "engine", Manifest.read(version_dir / "engine"), TINY_TRANSFORMER,
                              Communicator.single())
    x = torch.randn(1, 5, 32)
    expected = reference_module("tiny_transformer", CONFIG, random_weights("tiny_transformer", CONFIG, 4), "FP32")(x)
    assert torch.allclose(engine.forward({"hidden_states": x})["output"], expected["output"], atol=1e-6)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "shard0.safetensors").write_bytes((d / "shard0.safetensors").read_bytes()[:-10]), "truncated"),
    (lambda d: (d / "shard0.safetensors").write_bytes(b"x" * (d / "shard0.safetensors").stat().st_size),
     "not a readable safetensors file"),
    (lambda d: (d / "shard0.safetensors").unlink(), "missing"),
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
        TorchEngine.load(engine_dir, Manifest.read(engine_dir), TINY_TRANSFORMER, Communicator.single())
    assert str(engine_dir) in str(caught.value)


def test_engine_for_another_plan_is_refused(tmp_path):
    engine_dir = build(tmp_path) / "engine"
    assert Manifest.read(engine_dir).plan.world_size == 2
    with pytest.raises(EngineError, match="built for world 2"):
        TorchEngine.load(engine_dir, Manifest.read(engine_dir), TINY_TRANSFORMER, Communicator.single())


def test_limits_are_recorded_in_the_manifest(tmp_path):
    assert Manifest.read(build(tmp_path) / "engine").limits == EngineLimits()  # the defaults
    version_dir = build(tmp_path, limits=EngineLimits(max_batch_size=3, max_tokens=100))
    assert Manifest.read(version_dir / "engine").limits == EngineLimits(max_batch_size=3, max_tokens=100)
    assert main(["build", str(tmp_path), "--name", "cli", "--tp", "2", "--max-batch-size", "2",
                 "--max-tokens", "50", "--config", json.dumps(CONFIG)]) == 0
    assert Manifest.read(tmp_path / "cli" / "1" / "engine").limits == EngineLimits(max_batch_size=2, max_tokens=50)
    with pytest.raises(ValueError, match="max_batch_size and max_tokens must be >= 1"):
        EngineLimits(max_batch_size=0)


def test_version_policy_is_set_kept_and_replaced(tmp_path):
    build(tmp_path, policy="all")
    assert read_model_config(tmp_path / "m" / "config.pbtxt").version_policy.HasField("all")
    build(tmp_path, seed=1)  # no policy given: the model keeps its own
    assert read_model_config(tmp_path / "m" / "config.pbtxt").version_policy.HasField("all")
    build(tmp_path, seed=2, policy="specific:1,3")
    assert list(read_model_config(tmp_path / "m" / "config.pbtxt").version_policy.specific.versions) == [1, 3]
    build(tmp_path, seed=3, policy="latest:2")
    assert read_model_config(tmp_path / "m" / "config.pbtxt").version_policy.latest.num_versions == 2
    assert not read_model_config(tmp_path / "m" / "config.pbtxt").version_policy.HasField("specific")


def test_parameters_added_by_hand_are_kept_by_later_builds(tmp_path):
    build(tmp_path)
    path = tmp_path / "m" / "config.pbtxt"
    path.write_text(path.read_text() + 'parameters { key: "EXECUTION_ENV_PATH" value { string_value: "env.tar.gz" } }\n')
    build(tmp_path, seed=1, request_timeout_s=60.0)
    parameters = read_model_config(path).parameters
    assert parameters["EXECUTION_ENV_PATH"].string_value == "env.tar.gz"
    assert parameters["request_timeout_s"].string_value == "60.0"  # the build's own parameters are the new ones


@pytest.mark.parametrize("policy", ["latest:0", "latest", "specific:", "specific:0,1", "everything", "all:1"])
def test_bad_version_policy_is_refused_before_anything_is_written(tmp_path, policy):
    with pytest.raises(ValueError, match="use 'all', 'latest:K'"):
        build(tmp_path, policy=policy)
    assert not (tmp_path / "m").exists()


def test_config_tells_the_plan_and_warms_up_every_rank(tmp_path):
    build(tmp_path, name="f", architecture_name="flux", config=None, plan=ParallelPlan(cp_size=2, cp_method="ring"))
    config = read_model_config(tmp_path / "f" / "config.pbtxt")
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters["architecture"] == "flux" and parameters["data_type"] == "FP32"
    assert parameters["parallel_plan"] == "world 2 = tp 1 x cp 2 (ring)"
    [warmup] = config.model_warmup
    assert warmup.batch_size == 1 and set(warmup.inputs) == {i.name for i in config.input}
    # Every variable dimension is cp_size, so each context-parallel rank gets real tokens.
    assert list(warmup.inputs["hidden_states"].dims) == [2, 2, 8] and list(warmup.inputs["img_ids"].dims) == [2, 3]
    assert all(sample.zero_data for sample in warmup.inputs.values())


def test_a_version_with_another_plan_of_the_same_size_is_refused(tmp_path):
    flux = dict(name="f", architecture_name="flux", config=None)
    build(tmp_path, **flux, plan=ParallelPlan(tp_size=2))
    with pytest.raises(ValueError, match="parameter parallel_plan differs"):
        build(tmp_path, **flux, plan=ParallelPlan(cp_size=2))


class InterruptAtRank1:
    """A weight source that is stopped (as by Ctrl-C) when rank 1's weights are being read."""

    def __init__(self, source):
        self.source = source
        self.reads = 0

    def read(self, name, split=None):
        self.reads += 1
        if split is not None and split[2] == 1:
            raise KeyboardInterrupt
        return self.source.read(name, split)

    def fingerprint(self):
        return self.source.fingerprint()


def test_interrupted_build_resumes_and_keeps_verified_rank_files(tmp_path):
    shapes = full_shapes("tiny_transformer", CONFIG)
    plan = ParallelPlan(tp_size=2)
    interrupted = InterruptAtRank1(RandomWeights(shapes, seed=5))
    with pytest.raises(KeyboardInterrupt):
        build_engine(tmp_path / "engine", "tiny_transformer", CONFIG, plan, "FP32", interrupted, progress=False)
    rank0 = tmp_path / "engine" / "shard0.safetensors"
    written = rank0.stat().st_mtime_ns
    assert not (tmp_path / "engine" / "manifest.json").exists()  # an interrupted build never looks complete

    manifest = build_engine(tmp_path / "engine", "tiny_transformer", CONFIG, plan, "FP32",
                            RandomWeights(shapes, seed=5), progress=False)
    assert rank0.stat().st_mtime_ns == written  # kept, not rewritten
    fresh = build_engine(tmp_path / "fresh", "tiny_transformer", CONFIG, plan, "FP32", RandomWeights(shapes, seed=5),
                         progress=False)
    assert manifest.weights == fresh.weights  # the same bytes as an uninterrupted build
    assert not (tmp_path / "engine" / "build-progress.json").exists()


def test_resume_rewrites_a_damaged_rank_file(tmp_path):
    shapes = full_shapes("tiny_transformer", CONFIG)
    plan = ParallelPlan(tp_size=2)
    with pytest.raises(KeyboardInterrupt):
        build_engine(tmp_path / "engine", "tiny_transformer", CONFIG, plan, "FP32",
                     InterruptAtRank1(RandomWeights(shapes, seed=5)), progress=False)
    rank0 = tmp_path / "engine" / "shard0.safetensors"
    rank0.write_bytes(rank0.read_bytes()[:-8] + b"damaged!")
    manifest = build_engine(tmp_path / "engine", "tiny_transformer", CONFIG, plan, "FP32",
                            RandomWeights(shapes, seed=5), progress=False)
    fresh = build_engine(tmp_path / "fresh", "tiny_transformer", CONFIG, plan, "FP32", RandomWeights(shapes, seed=5),
                         progress=False)
    assert manifest.weights == fresh.weights and file_sha256(rank0) == fresh.weights[0].sha256


def test_interrupted_version_build_says_how_to_resume(tmp_path, monkeypatch):
    import mdtriton.build_tools.build as build_module

    original = build_module.RandomWeights
    monkeypatch.setattr(build_module, "RandomWeights", lambda *args: InterruptAtRank1(original(*args)))
    with pytest.raises(BuildInterrupted, match="run the same command again to resume") as caught:
        build(tmp_path)
    staging = next((tmp_path / "m").glob(".building-*"))
    assert str(staging) in str(caught.value)
    monkeypatch.setattr(build_module, "RandomWeights", original)
    assert build(tmp_path) == tmp_path / "m" / "1"
    assert not any((tmp_path / "m").glob(".building-*"))
