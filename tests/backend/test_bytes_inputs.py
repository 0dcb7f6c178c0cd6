"""BYTES (TYPE_STRING) inputs on the embedded Triton 2.51 under numpy 2 (mdtriton/stub_environment.py).

The 2.51 Python-backend stub unpacks a request's strings through numpy before `execute` runs; under numpy 2 it gets
garbage and dies. The embedded server runs its stubs with numpy 1.26 first on their path, so BYTES reach
`execute`. Both halves are shown with a model that answers with its text's length and its stub's numpy version.
If the second test fails, the stub in use reads BYTES under numpy 2 by itself and the stub environment can go.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

import mdtriton.server
from mdtriton.build_tools.model_config import write_model_config

MODEL_PY = '''
import numpy
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text").as_numpy()
            answer = torch.tensor([len(text[0]), int(numpy.__version__.split(".")[0])], dtype=torch.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("answer", to_dlpack(answer))]))
        return responses
'''


def serve_bytes_model(tmp_path, server_factory):
    """A server with the model above, and the BYTES request "a cat"."""
    (tmp_path / "repository" / "takes_bytes" / "1").mkdir(parents=True)
    (tmp_path / "repository" / "takes_bytes" / "1" / "model.py").write_text(MODEL_PY)
    config = mc.ModelConfig(name="takes_bytes", backend="python", max_batch_size=0, instance_group=[
        mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)])
    config.input.append(mc.ModelInput(name="text", data_type=mc.TYPE_STRING, dims=[-1]))
    config.output.append(mc.ModelOutput(name="answer", data_type=mc.TYPE_INT32, dims=[2]))
    write_model_config(tmp_path / "repository" / "takes_bytes" / "config.pbtxt", config)
    # Triton waits its exit timeout for a dead stub at shutdown: 2 s, not 30.
    server = server_factory(tmp_path / "repository", extra_args=("--exit-timeout-secs=2",))
    text = grpcclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array(["a cat".encode()], dtype=np.object_))
    return server, text


@pytest.mark.timeout(240)
def test_bytes_reach_execute_in_the_stubs_numpy_1_environment(tmp_path, server_factory):
    assert int(np.__version__.split(".")[0]) >= 2  # this process, and the rank workers, run numpy 2
    server, text = serve_bytes_model(tmp_path, server_factory)
    answer = grpcclient.InferenceServerClient(server.grpc_address).infer("takes_bytes", [text]).as_numpy("answer")
    assert answer.tolist() == [5, 1]  # "a cat", read by a stub running numpy 1


@pytest.mark.timeout(240)
def test_without_it_a_bytes_input_kills_the_stub_under_numpy_2(tmp_path, server_factory, monkeypatch):
    monkeypatch.setattr(mdtriton.server, "stub_environment", lambda: tmp_path / "no-environment")
    server, text = serve_bytes_model(tmp_path, server_factory)
    with pytest.raises(InferenceServerException) as caught:
        grpcclient.InferenceServerClient(server.grpc_address).infer("takes_bytes", [text])
    assert "is not healthy" in caught.value.message()
    assert "unpack_from requires a buffer" in (tmp_path / "server0.log").read_text()


def test_a_system_library_directory_stays_off_the_servers_library_path():
    """libpython's directory goes on the server's LD_LIBRARY_PATH only where the loader would not search it anyway:
    listed there, a system directory is searched before torch's own libraries by every process the stubs start (an
    older cuDNN in /usr/lib/x86_64-linux-gnu replaced torch's on GPU hosts, and its attention with it)."""
    assert mdtriton.server.libpython_directories("/usr/lib/x86_64-linux-gnu", "x86_64-linux-gnu") == []
    assert mdtriton.server.libpython_directories("/usr/lib/", None) == []
    assert mdtriton.server.libpython_directories("/opt/python/lib", "x86_64-linux-gnu") == ["/opt/python/lib"]
