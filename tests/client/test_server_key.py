"""The embedded server's key (client/server_key.py): where it lies, who may read it, and how the client sends it."""

from __future__ import annotations

import stat

import numpy as np
import pytest

from mdtriton.client.grpc_client import Client, ClientError
from mdtriton.client.server_key import GRPC_HEADER, KEY_FILE_ENV, key_file, key_headers
from mdtriton.server import ServerError, TritonServer


def test_the_key_lies_where_only_the_servers_user_can_read_it(served_models):
    path = served_models.key_file
    assert path == key_file(served_models.grpc_port) and path.read_text().strip() == served_models.key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert key_headers(served_models.grpc_address) == {GRPC_HEADER: served_models.key}
    assert key_headers(f"localhost:{served_models.grpc_port}") == {GRPC_HEADER: served_models.key}


def test_without_the_key_model_control_and_shared_memory_are_refused_in_one_line(served_models):
    with Client(served_models.grpc_address, shm_threshold=0) as client:
        client.headers = {}
        with pytest.raises(ClientError) as refused:
            client.repository_index()
        # Shared memory falls back to the gRPC messages (with a warning): the request is still answered.
        answer = client.infer("tiny", {"hidden_states": np.ones((1, 2, 64), np.float32)}, version="1")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("repository index: the server takes this only from clients that hold its key")
    assert KEY_FILE_ENV in message and str(served_models.key_file) in message
    assert answer["output"].shape == (1, 2, 64) and client.shm_threshold is None


def test_the_key_file_named_by_the_environment_comes_first(served_models, tmp_path, monkeypatch):
    wrong, right = tmp_path / "wrong.key", tmp_path / "right.key"
    wrong.write_text("not the key\n")
    right.write_text(served_models.key + "\n")
    monkeypatch.setenv(KEY_FILE_ENV, str(wrong))
    with Client(served_models.grpc_address) as client, pytest.raises(ClientError, match="hold its key"):
        client.repository_index()
    monkeypatch.setenv(KEY_FILE_ENV, str(right))
    with Client(served_models.grpc_address) as client:
        assert {"name": "tiny", "version": "1", "state": "READY"} in client.repository_index()
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match=f"cannot read the server's key from {tmp_path / 'missing.key'}"):
        Client(served_models.grpc_address)


def test_a_server_that_cannot_start_leaves_the_running_ones_key(served_models, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ServerError, match="exited"):
        TritonServer(tmp_path / "empty", grpc_port=served_models.grpc_port, log_file=tmp_path / "log").start(60)
    assert served_models.key_file.read_text().strip() == served_models.key
