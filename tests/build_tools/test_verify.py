"""Weight file checks: cheap ones at every load (size, safetensors header naming the rank), the SHA-256 in
`mdtriton verify`."""

from __future__ import annotations

import pytest

from mdtriton.build_tools.build import build_model_version
from mdtriton.cli import main
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.plan import ParallelPlan

CONFIG = {"hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "num_layers": 1}


@pytest.fixture
def version_dir(tmp_path):
    return build_model_version(tmp_path, "m", "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu",
                               progress=False)


def flip_last_tensor_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_good_version_verifies(version_dir, capsys):
    assert main(["verify", str(version_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"ok {version_dir / 'engine' / f'rank{rank}.safetensors'}" for rank in (0, 1)]


def test_damaged_tensor_bytes_pass_the_load_checks_and_fail_verify(version_dir, capsys):
    engine_dir = version_dir / "engine"
    flip_last_tensor_byte(engine_dir / "rank1.safetensors")
    manifest = Manifest.read(engine_dir)
    assert manifest.weight_file(engine_dir, 1) == engine_dir / "rank1.safetensors"  # size and header are intact
    assert main(["verify", str(version_dir)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ok {engine_dir / 'rank0.safetensors'}"
    assert lines[1].startswith("FAILED") and "rank1.safetensors" in lines[1] and "fails its checksum" in lines[1]


def test_swapped_rank_files_of_equal_size_fail_the_load_checks(version_dir):
    engine_dir = version_dir / "engine"
    rank0, rank1 = engine_dir / "rank0.safetensors", engine_dir / "rank1.safetensors"
    assert rank0.stat().st_size == rank1.stat().st_size  # so the size check alone would pass
    data0 = rank0.read_bytes()
    rank0.write_bytes(rank1.read_bytes())
    rank1.write_bytes(data0)
    with pytest.raises(EngineError, match=r"rank0.safetensors: weight file of rank 0 says it holds 'rank 1 of world 2"):
        Manifest.read(engine_dir).weight_file(engine_dir, 0)


def test_a_broken_header_of_the_right_size_fails_the_load_checks(version_dir):
    engine_dir = version_dir / "engine"
    path = engine_dir / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF  # the header's first byte, "{", after its 8-byte length
    path.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="rank0.safetensors: not a readable safetensors file"):
        Manifest.read(engine_dir).weight_file(engine_dir, 0)


def test_a_directory_that_is_no_model_version_gets_a_clear_error(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "manifest.json" in error and "mdtriton build" in error
