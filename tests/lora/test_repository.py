"""`mdtriton lora add | list | remove` against a model repository, and a rank's adapters kept up to its cap.

`add` refuses, with a message naming what is wrong and writing nothing, an adapter made for another model (a shape or
a module that is not the model's), one that also changes the text encoder, a corrupt or truncated file, a name taken
or not a name, and a model that is not a pipeline.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FluxPipeline
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mdtriton.build_tools.adapters import add_adapter
from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.cli import main
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.lora.adapter_file import AdapterError, read_adapter, read_user_adapter
from mdtriton.lora.directory import AdapterSettings, adapters_dir
from mdtriton.serving import load_engine
from tests.lora.adapters import diffusers_lora
from tests.pipeline.pipelines import save_pipelines

TEXT_ENCODER_Q = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_repository")
    pipeline_dir = save_pipelines(root)["dev"]
    repository = root / "repository"
    build_model_version(repository, "flux", BuildRequest(
        "flux-pipeline", None, ParallelPlan(), "FP32", "cpu", weights_path=pipeline_dir, progress=False))
    build_model_version(repository, "transformer", BuildRequest(
        "flux", None, ParallelPlan(), "FP32", "cpu", progress=False))
    transformer = FluxPipeline.from_pretrained(pipeline_dir, local_files_only=True).transformer
    good = diffusers_lora(root / "good.safetensors", transformer, seed=1, rank=4)
    return repository, good, transformer


def nothing_written(repository) -> bool:
    directory = adapters_dir(repository / "flux")
    return not directory.exists() or all(path.name == "kept.safetensors" for path in directory.iterdir())


def test_the_cli_adds_lists_and_removes(repository, tmp_path, capsys):
    repository, good, _ = repository
    # A directory holding diffusers' file name works too.
    (tmp_path / "style").mkdir()
    (tmp_path / "style" / "pytorch_lora_weights.safetensors").write_bytes(good.read_bytes())
    assert main(["lora", "add", str(repository), "flux", str(tmp_path / "style"), "--name", "style"]) == 0
    assert "added style to flux: 30 modules, rank 4" in capsys.readouterr().out
    assert main(["lora", "list", str(repository), "flux"]) == 0
    assert capsys.readouterr().out.startswith("style\t30 modules\trank 4\t")
    assert main(["lora", "add", str(repository), "flux", str(good), "--name", "style"]) == 1
    assert "flux already has an adapter 'style'; remove it first" in capsys.readouterr().err
    assert main(["lora", "remove", str(repository), "flux", "style"]) == 0
    assert main(["lora", "list", str(repository), "flux"]) == 0
    assert "flux has no adapters" in capsys.readouterr().out
    assert main(["lora", "remove", str(repository), "flux", "style"]) == 1
    assert "flux has no adapter 'style'" in capsys.readouterr().err


def mangled(path, tmp_path, change) -> str:
    tensors = load_file(path)
    change(tensors)
    target = tmp_path / "mangled.safetensors"
    save_file(tensors, target)
    return target


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"transformer.x_embedder.lora_A.weight": torch.zeros(4, 9)}),
     "the adapter's x_embedder has A [4, 9] and B [64, 4], where flux version 1's weight is [64, 8]"),
    (lambda t: t.update({"transformer.transformer_blocks.7.attn.to_q.lora_A.weight": torch.zeros(4, 64),
                         "transformer.transformer_blocks.7.attn.to_q.lora_B.weight": torch.zeros(64, 4)}),
     "the adapter changes transformer_blocks.7.attn.to_q, which is not a linear layer of flux version 1's flux "
     "transformer: it was made for another model"),
    (lambda t: t.update({f"{TEXT_ENCODER_Q}.lora_A.weight": torch.zeros(4, 24),
                         f"{TEXT_ENCODER_Q}.lora_B.weight": torch.zeros(24, 4)}),
     "the adapter also changes text_encoder; mdtriton applies adapters to the transformer only"),
    (lambda t: t.pop("transformer.x_embedder.lora_B.weight"), "module x_embedder has no lora_B"),
    (lambda t: t.update({"transformer.x_embedder.lora_magnitude_vector": torch.ones(64)}),
     "mdtriton serves LoRA factors (lora_A, lora_B) only"),
])
def test_an_adapter_of_another_model_is_refused(repository, tmp_path, change, message):
    repository, good, _ = repository
    with pytest.raises(AdapterError) as refused:
        add_adapter(repository, "flux", mangled(good, tmp_path, change), "other")
    assert message in str(refused.value)
    assert nothing_written(repository)


def test_a_corrupt_or_truncated_file_is_refused(repository, tmp_path):
    repository, good, _ = repository
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:len(good.read_bytes()) // 2])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64 + b"not a safetensors file")
    for path in (truncated, garbage):
        with pytest.raises(AdapterError) as refused:
            add_adapter(repository, "flux", path, "broken")
        assert "not a LoRA file that diffusers' FluxPipeline reads" in str(refused.value)
    with pytest.raises(AdapterError, match="no such file"):
        add_adapter(repository, "flux", tmp_path / "missing.safetensors", "broken")
    assert nothing_written(repository)


def test_names_and_models_are_checked(repository):
    repository, good, _ = repository
    with pytest.raises(ValueError, match="adapter name '../x': use 1 to 100 letters"):
        add_adapter(repository, "flux", good, "../x")
    with pytest.raises(ValueError, match="transformer version 1 serves a transformer engine \\(flux\\), not a "
                                         "pipeline: adapters are for pipeline models"):
        add_adapter(repository, "transformer", good, "style")
    with pytest.raises(ValueError, match="no model versions there"):
        add_adapter(repository, "nosuch", good, "style")
    assert nothing_written(repository)


def test_a_pipeline_without_a_lora_loader_takes_no_adapter(repository):
    """diffusers' Cosmos3OmniPipeline has no LoRA loader: an adapter for it is refused saying so."""
    _, good, _ = repository
    with pytest.raises(AdapterError, match="diffusers' Cosmos3OmniPipeline has no LoRA loader"):
        read_user_adapter(good, "Cosmos3OmniPipeline")


def test_a_rank_keeps_its_adapters_up_to_the_cap(repository, tmp_path):
    """Loaded adapters stay until they no longer fit the cap, the least recently used dropped first; a request's own
    adapters are loaded whatever the cap; an adapter added again under its name is read again."""
    repository, _, transformer = repository
    directory = tmp_path / "loras"
    directory.mkdir()
    for index, name in enumerate("abc"):
        add_adapter(repository, "flux", diffusers_lora(tmp_path / f"{name}.safetensors", transformer, index, 4),
                    f"cap-{name}")
    for name in "abc":
        (directory / f"{name}.safetensors").write_bytes(
            (adapters_dir(repository / "flux") / f"cap-{name}.safetensors").read_bytes())
        (adapters_dir(repository / "flux") / f"cap-{name}.safetensors").unlink()
    engine_dir = repository / "flux" / "1" / ENGINE_DIR
    engine = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single(), AdapterSettings(directory, 0))
    weights = engine.adapters
    one = None
    for name in "abc":
        weights.activate({name: 1.0})
        one = one or weights.loaded[name].bytes
        assert list(weights.loaded) == [name]  # cap 0: only the request's own
    weights.cache_bytes = 2 * one
    for name in "abc":
        weights.activate({name: 1.0})
    weights.activate({"b": 0.5})
    assert list(weights.loaded) == ["c", "b"]  # a, least recently used, dropped for c
    weights.activate({"a": 1.0, "b": 1.0})
    assert sorted(weights.loaded) == ["a", "b"]
    before = weights.loaded["a"]
    (directory / "a.safetensors").write_bytes((directory / "c.safetensors").read_bytes())  # "a" added anew
    weights.activate({"a": 1.0})
    assert weights.loaded["a"] is not before and weights.loaded["a"].identity != before.identity
    merged = weights.merged
    (directory / "a.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter 'a' in"):
        weights.activate({"b": 1.0, "a": 1.0})
    assert weights.merged == merged  # nothing was changed: the weights still hold what the last request merged
    weights.activate({})
    assert not weights.saved and weights.merged == ()


def test_an_adapter_with_nan_or_of_rank_0_is_refused_in_one_line(repository, tmp_path, capsys):
    """Neither would serve: a NaN factor makes every image it changes flat (answered as if right), a rank-0 adapter
    divides its alpha by 0. `mdtriton lora add` says so in one line and writes nothing."""
    repository, good, _ = repository
    nan = mangled(good, tmp_path, lambda t: t["transformer.x_embedder.lora_B.weight"].__setitem__((0, 0), math.nan))
    assert main(["lora", "add", str(repository), "flux", str(nan), "--name", "nan"]) == 1
    assert "x_embedder's lora_B holds NaN or infinite values" in capsys.readouterr().err
    rank_0 = mangled(good, tmp_path, lambda t: t.update({key: value[:0] if "lora_A" in key else value[:, :0]
                                                         for key, value in t.items()}))
    assert main(["lora", "add", str(repository), "flux", str(rank_0), "--name", "empty"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1 and "rank 0" in error, error
    assert main(["lora", "add", str(repository), "../flux", str(good), "--name", "x"]) == 1
    assert "model name '../flux'" in capsys.readouterr().err
    assert nothing_written(repository)


def test_a_kept_adapter_changed_to_hold_nan_is_refused_at_load(repository, tmp_path):
    repository, good, _ = repository
    add_adapter(repository, "flux", good, "spoiled")
    kept = adapters_dir(repository / "flux") / "spoiled.safetensors"
    try:
        with safe_open(kept, framework="pt") as file:
            metadata, tensors = file.metadata(), {key: file.get_tensor(key) for key in file.keys()}
        tensors["x_embedder.lora_A.weight"][0, 0] = math.inf
        save_file(tensors, kept, metadata=metadata)
        with pytest.raises(AdapterError, match="x_embedder's lora_A holds NaN or infinite values"):
            read_adapter(kept)
    finally:
        kept.unlink()
