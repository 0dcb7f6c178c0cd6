"""Why prompts are UINT8 rows and not BYTES (mdtriton/pipeline/prompts.py): the Python backend of Triton 2.51 under
numpy 2 cannot take a BYTES input at all. Its stub unpacks the strings through numpy before `execute` runs, gets
garbage, and dies. If this test fails, the server in use takes BYTES: prompts could then be BYTES."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.model_config import write_model_config

# A model that never looks at its input: whatever fails, fails before execute.
MODEL_PY = '''
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack


class TritonPythonModel:
    def execute(self, requests):
        answer = torch.ones(1, dtype=torch.int32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("ok", to_dlpack(answer))]) for _ in requests]
'''


@pytest.mark.timeout(240)
def test_a_bytes_input_kills_the_stub_under_numpy_2(tmp_path, server_factory):
    assert int(np.__version__.split(".")[0]) >= 2
    (tmp_path / "repository" / "takes_bytes" / "1").mkdir(parents=True)
    (tmp_path / "repository" / "takes_bytes" / "1" / "model.py").write_text(MODEL_PY)
    config = mc.ModelConfig(name="takes_bytes", backend="python", max_batch_size=0, instance_group=[
        mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)])
    config.input.append(mc.ModelInput(name="text", data_type=mc.TYPE_STRING, dims=[-1]))
    config.output.append(mc.ModelOutput(name="ok", data_type=mc.TYPE_INT32, dims=[1]))
    write_model_config(tmp_path / "repository" / "takes_bytes" / "config.pbtxt", config)
    # Triton waits its exit timeout for the dead stub at shutdown: 2 s, not 30.
    server = server_factory(tmp_path / "repository", extra_args=("--exit-timeout-secs=2",))
    text = grpcclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array(["a cat".encode()], dtype=object))
    with pytest.raises(InferenceServerException) as caught:
        grpcclient.InferenceServerClient(server.grpc_address).infer("takes_bytes", [text])
    assert "is not healthy" in caught.value.message()
    log = (tmp_path / "server0.log").read_text()
    assert "unpack_from requires a buffer" in log
