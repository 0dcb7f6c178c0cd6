"""Another local user against the embedded server (uid 65534 through setpriv): it can neither take the server down
through Triton's shared-memory protocol nor read the tensors that travel through /dev/shm."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mdtriton.client.grpc_client import Client
from mdtriton.testing.triton_processes import rank_workers, stub_processes
from tests.other_user import run_as_other_user
from tests.served_models import tiny_reference

# Register a region of /dev/shm by its key over HTTP, then ask for an output placed in it: the answer written there
# lands on the Python backend's own structures (its mutex at offset 0) and Triton 2.51 aborts. The server's key, if
# its command line shows one, goes with the requests.
ATTACK = """
import json, sys, urllib.error, urllib.request
url, key, server_pid = sys.argv[1:]
arguments = open(f"/proc/{server_pid}/cmdline", "rb").read().decode().split("\\0")
shown = [argument.rpartition("mdtriton-key=")[2] for argument in arguments if "mdtriton-key=" in argument]

def post(path, body):
    headers = {"Content-Type": "application/json", **({"mdtriton-key": shown[0]} if shown else {})}
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()

registered = post("/v2/systemsharedmemory/region/neighbour/register", {"key": key, "offset": 0, "byte_size": 4096})
answered = post("/v2/models/tiny/versions/1/infer", {
    "inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [1, 4, 64], "data": [0.5] * 256}],
    "outputs": [{"name": "output", "parameters": {"shared_memory_region": "neighbour",
                                                  "shared_memory_byte_size": 1024}}]})
print(json.dumps({"registered": registered, "answered": answered, "keys shown": shown}))
"""

# Open each file named and look for the marker's bytes in it.
READ = """
import json, sys
marker = bytes.fromhex(sys.argv[1])
found = {}
for path in sys.argv[2:]:
    try:
        with open(path, "rb") as file:
            found[path] = "marker read" if marker in file.read() else "opened"
    except OSError as error:
        found[path] = type(error).__name__
print(json.dumps(found))
"""


def python_backend_regions(server_pid: int) -> dict[str, Path]:
    """The /dev/shm region of each of the server's Python backend stubs (the stub's second argument), by stub name."""
    regions = {}
    for name, pid in stub_processes(server_pid).items():
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        regions[name] = Path("/dev/shm") / arguments[2].decode()
    return regions


def tensor_links(pids: list[int]) -> list[str]:
    """/proc/PID/fd/N of the memfds through which stubs and rank workers pass tensors (backend/tensor_transfer.py)."""
    links = []
    for pid in pids:
        for descriptor in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if "memfd:mdtriton-tensors" in str(descriptor.readlink()):
                    links.append(str(descriptor))
            except OSError:
                continue
    return links


def test_another_user_cannot_crash_the_server_through_its_python_backend_region(served_models):
    server_pid = served_models.process.pid
    region = python_backend_regions(server_pid)["tiny/1/rank_0"]
    attack = run_as_other_user(ATTACK, f"http://{served_models.http_address}", "/" + region.name, str(server_pid))
    assert attack["keys shown"] == ["x" * len(served_models.key)] * 2, attack  # blanked in the command line
    code, text = attack["registered"]
    assert code == 403 and "restricted" in text, attack  # Triton's restricted API: the key is missing
    assert attack["answered"] == [404, '{"error":"Unable to find shared memory region: \'neighbour\'"}'], attack
    # gRPC is restricted alike.
    with pytest.raises(InferenceServerException, match="restricted") as refused:
        grpcclient.InferenceServerClient(served_models.grpc_address).register_system_shared_memory(
            "neighbour", "/" + region.name, 4096)
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    # The server is up and answers the next request rightly.
    x = np.random.default_rng(0).standard_normal((1, 5, 64), dtype=np.float32)
    with Client(served_models.grpc_address) as client:
        answer = client.infer("tiny", {"hidden_states": x}, version="1")["output"]
    assert served_models.process.poll() is None
    assert np.abs(answer - tiny_reference("1", x).numpy()).max() < 1e-5


def test_another_user_cannot_read_the_tensors_in_shared_memory(served_models):
    x = np.random.default_rng(1).standard_normal((1, 6, 64), dtype=np.float32)
    with Client(served_models.grpc_address) as client:
        client.infer("tiny", {"hidden_states": x}, version="2")
    server_pid = served_models.process.pid
    regions = [str(path) for path in python_backend_regions(server_pid).values()]
    workers = [pid for pids in rank_workers(server_pid).values() for pid in pids]
    links = tensor_links(list(stub_processes(server_pid).values()) + workers)
    assert len(regions) == 6 and links  # tiny v1, v2 and flux, 2 ranks each; the stubs' links to their workers
    found = run_as_other_user(READ, x[0, 0, :16].tobytes().hex(), *regions, *links, str(served_models.key_file))
    assert set(found.values()) == {"PermissionError"}, found
