"""Bad engines in a real tritonserver: the load fails with a message naming the file and the problem, the
model is not served, and nothing of it is left running. Weights are only ever read as safetensors."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.server_key import key_headers
from mdtriton.build_tools.model_config import read_model_config, write_model_config
from mdtriton.engine.manifest import MANIFEST_FILE, file_sha256
from mdtriton.engine.plan import ParallelPlan
from tests.backend.load_clients import CONFIG, Reference, ask
from mdtriton.testing.triton_processes import files_under, rank_workers, stub_processes, wait_for_stubs


class RunsWhenUnpickled:
    """A pickle that would leave a file behind if anything ever unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def set_weight_file(engine: Path, rank: int, data: bytes) -> None:
    """Replace rank's weight file and make the manifest vouch for it (size and checksum), so only the format is wrong."""
    path = engine / f"shard{rank}.safetensors"
    path.write_bytes(data)
    manifest = json.loads((engine / MANIFEST_FILE).read_text())
    manifest["weights"][rank].update(bytes=path.stat().st_size, sha256=file_sha256(path))
    (engine / MANIFEST_FILE).write_text(json.dumps(manifest))


def edit_manifest(engine: Path, **changes) -> None:
    manifest = json.loads((engine / MANIFEST_FILE).read_text())
    (engine / MANIFEST_FILE).write_text(json.dumps({**manifest, **changes}))


def more_instances(model_dir: Path) -> None:
    config = read_model_config(model_dir / "config.pbtxt")
    config.instance_group[0].count = 3
    write_model_config(model_dir / "config.pbtxt", config)


def on_missing_gpus(model_dir: Path) -> None:
    """One instance per GPU, on GPUs 0 and 99: more ranks than this machine (any machine here) has GPUs."""
    config = read_model_config(model_dir / "config.pbtxt")
    del config.instance_group[:]
    config.instance_group.add(name="rank", kind=mc.ModelInstanceGroup.KIND_GPU, count=1, gpus=[0, 99])
    write_model_config(model_dir / "config.pbtxt", config)


def header_flipped(path: Path) -> bytes:
    """The file with the first byte of its safetensors header flipped: the size stays right, the header breaks.
    (Damage inside the tensors' bytes is for `mdtriton verify` to find: tests/build_tools/test_verify.py.)"""
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF
    return bytes(data)


# name -> (damage(engine dir, model dir, marker file), parts of the load error)
DAMAGES = {
    "truncated": (lambda e, m, x: (e / "shard1.safetensors").write_bytes((e / "shard1.safetensors").read_bytes()[:-100]),
                  ["shard1.safetensors", "truncated or replaced"]),
    "corrupted": (lambda e, m, x: (e / "shard0.safetensors").write_bytes(header_flipped(e / "shard0.safetensors")),
                  ["shard0.safetensors", "not a readable safetensors file"]),
    "missing": (lambda e, m, x: (e / "shard1.safetensors").unlink(), ["shard1.safetensors", "is missing"]),
    "newer_format": (lambda e, m, x: edit_manifest(e, format_version=99),
                     [MANIFEST_FILE, "format version 99", "upgrade mdtriton"]),
    "world_size": (lambda e, m, x: more_instances(m), ["engine has 2 ranks", "starts 3 instances"]),
    "unknown_architecture": (lambda e, m, x: edit_manifest(e, architecture="nonesuch"),
                             ["unknown architecture 'nonesuch'", "entry point group mdtriton.families"]),
    "missing_gpus": (lambda e, m, x: on_missing_gpus(m), ["invalid or unsupported gpu id"]),
    "pickled": (lambda e, m, x: set_weight_file(e, 0, pickle.dumps(RunsWhenUnpickled(x))),
                ["shard0.safetensors", "not a readable safetensors file"]),
}


@pytest.mark.timeout(300)
def test_bad_engines_fail_to_load_naming_the_file_and_leave_nothing_served(tmp_path, rendezvous_root,
                                                                           server_factory):
    repository = tmp_path / "repo"
    marker = tmp_path / "unpickled"
    for name, (damage, _) in DAMAGES.items():
        version_dir = build_model_version(repository, name, BuildRequest(
            "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=5, progress=False))
        damage(version_dir / "engine", version_dir.parent, marker)
    build_model_version(repository, "good", BuildRequest(
        "tiny_transformer", CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=5, progress=False))
    server = server_factory(repository, model_control_mode="explicit", load_models=("good",))
    client = grpcclient.InferenceServerClient(server.grpc_address)
    good_stubs = wait_for_stubs(server.process.pid, 2)
    reference = Reference(5)

    for name, (_, parts) in DAMAGES.items():
        with pytest.raises(InferenceServerException) as caught:
            client.load_model(name, headers=key_headers(server.grpc_address))
        message = caught.value.message()
        assert all(part in message for part in parts), f"{name}: {message}"
        assert not client.is_model_ready(name)
        assert ask(client, name, reference, 0).status in ("StatusCode.UNAVAILABLE", "StatusCode.NOT_FOUND")
        # Ranks that had loaded are unloaded with the failed model: only the good model's stubs are left.
        assert wait_for_stubs(server.process.pid, 2) == good_stubs, name
        outcome = ask(client, "good", reference, 1)
        assert outcome.status is None and outcome.right, f"after {name}: {outcome}"
    assert not marker.exists(), "a weight file was unpickled"
    assert [area for area in files_under(rendezvous_root) if "/" not in area] == [
        next(area for area in files_under(rendezvous_root) if "-good-" in area)]
    assert stub_processes(server.process.pid) == good_stubs
    assert sorted(map(len, rank_workers(server.process.pid).values())) == [1, 1]  # no worker of a failed load is left


def test_weights_are_never_read_with_pickle():
    """Safe loading: the package has no way to unpickle a file (no torch.load, pickle or numpy pickles)."""
    package = Path(__file__).resolve().parents[2]
    sources = [p for folder in ("mdtriton", "backend", "build_tools", "client") for p in (package / folder).rglob("*.py")]
    assert len(sources) > 20
    for path in sources:
        text = path.read_text()
        for forbidden in ("torch.load(", "import pickle", "pickle.load", "allow_pickle=True"):
            assert forbidden not in text, f"{path}: {forbidden}"
