"""Weight file checks: cheap ones at every load (size, safetensors header naming the shard), the SHA-256 in
`mdtriton verify`; one file per tensor-parallel shard, shared by its replicas, and the engines of format 3 (one file
per rank) still read."""

from __future__ import annotations

import dataclasses

import pytest
from safetensors.torch import load_file, save_file

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.cli import main
from mdtriton.engine.manifest import RANK_FILE_KEY, EngineError, Manifest, WeightFile, file_sha256
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX

CONFIG = {"hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "num_layers": 1}


@pytest.fixture
def version_dir(tmp_path):
    return build_model_version(tmp_path, "m", BuildRequest(
        "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", progress=False))


def flip_last_tensor_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_good_version_verifies(version_dir, capsys):
    assert main(["verify", str(version_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"ok {version_dir / 'engine' / f'shard{rank}.safetensors'}" for rank in (0, 1)]


def test_damaged_tensor_bytes_pass_the_load_checks_and_fail_verify(version_dir, capsys):
    engine_dir = version_dir / "engine"
    flip_last_tensor_byte(engine_dir / "shard1.safetensors")
    manifest = Manifest.read(engine_dir)
    assert manifest.weight_file(engine_dir, 1) == engine_dir / "shard1.safetensors"  # size and header are intact
    assert main(["verify", str(version_dir)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ok {engine_dir / 'shard0.safetensors'}"
    assert lines[1].startswith("FAILED") and "shard1.safetensors" in lines[1] and "fails its checksum" in lines[1]


def test_swapped_shard_files_of_equal_size_fail_the_load_checks(version_dir):
    engine_dir = version_dir / "engine"
    rank0, rank1 = engine_dir / "shard0.safetensors", engine_dir / "shard1.safetensors"
    assert rank0.stat().st_size == rank1.stat().st_size  # so the size check alone would pass
    data0 = rank0.read_bytes()
    rank0.write_bytes(rank1.read_bytes())
    rank1.write_bytes(data0)
    with pytest.raises(EngineError, match=r"shard0.safetensors: weight file of rank 0 says it holds 'tp shard 1 of world 2"):
        Manifest.read(engine_dir).weight_file(engine_dir, 0)


def test_a_broken_header_of_the_right_size_fails_the_load_checks(version_dir):
    engine_dir = version_dir / "engine"
    path = engine_dir / "shard0.safetensors"
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF  # the header's first byte, "{", after its 8-byte length
    path.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="shard0.safetensors: not a readable safetensors file"):
        Manifest.read(engine_dir).weight_file(engine_dir, 0)


def test_a_directory_that_is_no_model_version_gets_a_clear_error(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "manifest.json" in error and "mdtriton build" in error


def as_format_3(engine_dir) -> None:
    """Rewrite a built engine as format 3 kept it: one weight file per rank, its header naming the rank."""
    manifest = Manifest.read(engine_dir)
    files = []
    for rank in range(manifest.plan.world_size):
        path = engine_dir / f"rank{rank}.safetensors"
        shard = load_file(engine_dir / f"shard{manifest.plan.tp_rank(rank)}.safetensors")
        save_file(shard, path, metadata={RANK_FILE_KEY: f"rank {rank} of {manifest.plan}"})
        files.append(WeightFile(path.name, path.stat().st_size, file_sha256(path)))
    for shard_file in engine_dir.glob("shard*.safetensors"):
        shard_file.unlink()
    dataclasses.replace(manifest, weights=tuple(files), format_version=3).write(engine_dir)


def test_replicas_share_their_shard_file_and_an_engine_of_format_3_still_reads(tmp_path, capsys):
    plan = ParallelPlan(tp_size=2, cp_size=2, cp_method="ulysses")  # ranks 0 and 2 hold tp shard 0, 1 and 3 shard 1
    flux = {**FLUX.default_config(), "num_layers": 1, "num_single_layers": 1}
    version_dir = build_model_version(tmp_path, "m", BuildRequest("flux", flux, plan, "FP32", "cpu", progress=False))
    engine_dir = version_dir / "engine"
    manifest = Manifest.read(engine_dir)
    assert [manifest.weight_file(engine_dir, rank).name for rank in range(4)] == [
        "shard0.safetensors", "shard1.safetensors", "shard0.safetensors", "shard1.safetensors"]
    weights = [load_file(manifest.weight_file(engine_dir, rank)) for rank in range(4)]

    as_format_3(engine_dir)
    manifest = Manifest.read(engine_dir)
    assert manifest.format_version == 3
    assert [manifest.weight_file(engine_dir, rank).name for rank in range(4)] == [
        f"rank{rank}.safetensors" for rank in range(4)]
    for rank in range(4):
        old = load_file(manifest.verified_weight_file(engine_dir, rank))
        assert old.keys() == weights[rank].keys() and all(old[name].equal(weights[rank][name]) for name in old)
    assert main(["verify", str(version_dir)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"ok {engine_dir / f'rank{rank}.safetensors'}" for rank in range(4)]


def test_a_manifest_listing_too_few_weight_files_for_its_plan_fails_the_load_checks_naming_both_counts(version_dir):
    engine_dir = version_dir / "engine"
    manifest = Manifest.read(engine_dir)
    dataclasses.replace(manifest, weights=manifest.weights[:1]).write(engine_dir)
    with pytest.raises(EngineError, match=r"manifest lists 1 weight files, world 2 = tp 2 x cp 1 needs 2"):
        Manifest.read(engine_dir).weight_file(engine_dir, 0)
