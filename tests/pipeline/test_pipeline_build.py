"""`mdtriton build --architecture flux-pipeline`: what it refuses, saying what to give instead, and what it writes."""

from __future__ import annotations

import json
import shutil

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.build_tools.model_config import read_model_config
from mdtriton.cli import main
from mdtriton.testing.tiny_flux_pipeline import save_tiny_flux_pipeline


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    return save_tiny_flux_pipeline(tmp_path_factory.mktemp("pipeline") / "dev")


def build(repository, weights=None, *more) -> int:
    return main(["build", str(repository), "--name", "flux", "--architecture", "flux-pipeline", "--tp", "2", *more]
                + (["--weights", str(weights)] if weights else []))


def test_the_version_holds_the_engine_the_components_and_a_unary_config(pipeline_dir, tmp_path):
    assert build(tmp_path, pipeline_dir) == 0
    engine_dir = tmp_path / "flux" / "1" / "engine"
    assert sorted(p.name for p in engine_dir.iterdir()) == [
        "manifest.json", "model_index.json", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
        "transformer", "vae"]
    assert sorted(p.name for p in (engine_dir / "transformer").iterdir()) == [
        "manifest.json", "shard0.safetensors", "shard1.safetensors"]
    assert json.loads((engine_dir / "manifest.json").read_text())["architecture"] == "flux-pipeline"
    config = read_model_config(tmp_path / "flux" / "config.pbtxt")
    assert not config.model_transaction_policy.decoupled and not config.model_warmup
    assert [i.name for i in config.input if not i.optional] == ["prompt"]
    assert [i.data_type for i in config.input if i.name in ("prompt", "prompt_2")] == [mc.DataType.TYPE_STRING] * 2
    assert config.parameters["request_timeout_s"].string_value == "300.0"
    # What `mdtriton generate` sends for what its command line leaves out (the client has no family to ask)
    assert json.loads(config.parameters["request_defaults"].string_value) == {
        "height": 1024, "width": 1024, "num_inference_steps": 28, "guidance_scale": 3.5, "seed": 0, "prompt_2": None,
        "max_sequence_length": None}


def test_stream_makes_a_decoupled_model_and_a_version_cannot_change_it(pipeline_dir, tmp_path, capsys):
    assert build(tmp_path, pipeline_dir, "--stream") == 0
    assert read_model_config(tmp_path / "flux" / "config.pbtxt").model_transaction_policy.decoupled
    assert build(tmp_path, pipeline_dir) == 1  # version 2 without --stream: the model's config is shared
    assert "the new version's model_transaction_policy differs from the model's config" in capsys.readouterr().err
    assert main(["build", str(tmp_path), "--name", "tiny", "--stream"]) == 1
    assert "--stream and --cache are for pipeline models" in capsys.readouterr().err


def test_cache_is_the_models_default_step_cache_and_is_checked_first(pipeline_dir, tmp_path, capsys):
    assert build(tmp_path, pipeline_dir, "--cache", '{"method": "first_block", "threshold": -0.5}') == 1
    assert "--cache: cache threshold -0.5 is not a finite number >= 0" in capsys.readouterr().err
    assert not (tmp_path / "flux").exists()  # refused before any work
    cache = '{"method": "first_block", "threshold": 0.08}'
    assert build(tmp_path, pipeline_dir, "--cache", cache) == 0
    config = read_model_config(tmp_path / "flux" / "config.pbtxt")
    assert config.parameters["cache"].string_value == cache
    assert [(i.name, i.data_type, i.optional) for i in config.input if i.name == "cache"] == [
        ("cache", mc.DataType.TYPE_STRING, True)]
    assert [o.name for o in config.output] == ["image", "step", "full_steps"]


def test_without_weights_it_says_to_give_the_directory(tmp_path, capsys):
    assert build(tmp_path) == 1
    assert ("flux-pipeline builds from a diffusers FluxPipeline directory: give it with --weights DIR"
            in capsys.readouterr().err)


def test_a_directory_missing_a_component_is_refused_naming_it(pipeline_dir, tmp_path, capsys):
    shutil.copytree(pipeline_dir, tmp_path / "partial")
    shutil.rmtree(tmp_path / "partial" / "text_encoder_2")
    assert build(tmp_path / "repository", tmp_path / "partial") == 1
    assert "component folder(s) ['text_encoder_2'] missing" in capsys.readouterr().err
    assert not (tmp_path / "repository" / "flux").exists()


def test_an_fp8_pipeline_for_cpu_instances_is_refused_for_the_gpu_reason(pipeline_dir, tmp_path, capsys):
    """The one build path: the pipeline's FP8 build is refused as the transformer's is (it needs a GPU of compute
    capability 8.9+), not for a data type its signature cannot hold."""
    for architecture in ("flux", "flux-pipeline"):
        assert main(["build", str(tmp_path), "--name", architecture, "--architecture", architecture, "--dtype", "FP8",
                     "--weights", str(pipeline_dir if architecture == "flux-pipeline" else
                                      pipeline_dir / "transformer")]) == 1
        assert "FP8 engines run on GPUs of compute capability 8.9 or newer" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_an_fp8_pipeline_for_gpu_instances_builds_its_transformer_in_fp8(pipeline_dir, tmp_path):
    """On a host without GPUs (the build checks no device there), as for a deployment elsewhere."""
    assert build(tmp_path, pipeline_dir, "--dtype", "FP8", "--device", "gpu") == 0
    engine_dir = tmp_path / "flux" / "1" / "engine"
    transformer = json.loads((engine_dir / "transformer" / "manifest.json").read_text())
    assert (transformer["quantization"], transformer["data_type"]) == ("fp8", "BF16")
    assert json.loads((engine_dir / "manifest.json").read_text())["data_type"] == "BF16"


def test_guidance_parallelism_is_refused_for_a_pipeline_without_guidance_branches(pipeline_dir, tmp_path, capsys):
    assert build(tmp_path, pipeline_dir, "--cfg", "2") == 1
    assert "flux-pipeline has no classifier-free guidance branches" in capsys.readouterr().err
    assert main(["build", str(tmp_path), "--name", "tiny", "--cfg", "2"]) == 1
    assert "build it with --cfg 1" in capsys.readouterr().err
