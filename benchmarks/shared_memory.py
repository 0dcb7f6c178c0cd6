"""When does shared memory beat sending tensors in gRPC messages? A table of round-trip times by size.

Serves an identity model (Python backend, output = input, float32) with the embedded Triton server and
sends one tensor of each size through our Client three ways: in the gRPC messages, through system
shared memory, and (with a GPU and cuda-python) from a CUDA tensor through CUDA shared memory. The
model does no work, so the times are the transport's. Median of --repeat requests after 3 warm-ups, timed by the
benchmark harness (mdtriton/harness.py).

    python3 benchmarks/shared_memory.py [--sizes-kib 16 64 256 1024 4096 16384 65536] [--repeat 20]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.build_tools.model_config import write_model_config
from mdtriton.client.grpc_client import Client
from mdtriton.harness import markdown_table, started_server, time_calls, timing

IDENTITY_MODEL = '''
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "INPUT").to_dlpack())
            output = pb_utils.Tensor.from_dlpack("OUTPUT", to_dlpack(tensor))
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
'''


def write_identity_model(repository: Path) -> None:
    (repository / "identity" / "1").mkdir(parents=True)
    (repository / "identity" / "1" / "model.py").write_text(IDENTITY_MODEL)
    config = mc.ModelConfig(name="identity", backend="python", max_batch_size=0,
                            input=[mc.ModelInput(name="INPUT", data_type=mc.TYPE_FP32, dims=[-1])],
                            output=[mc.ModelOutput(name="OUTPUT", data_type=mc.TYPE_FP32, dims=[-1])],
                            instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)])
    write_model_config(repository / "identity" / "config.pbtxt", config)


def median_ms(client: Client, value, repeat: int) -> float:
    """The median milliseconds of a round trip of value, after 3 (which register the regions and learn the output
    size)."""
    times, outputs = time_calls(lambda: client.infer("identity", {"INPUT": value}), False, 3, repeat)
    assert outputs["OUTPUT"].shape == tuple(value.shape)
    return timing(times)["median_ms"]


def cuda_available() -> bool:
    try:
        import torch
        import tritonclient.utils.cuda_shared_memory  # noqa: F401 - needs cuda-python
    except (ImportError, RuntimeError):
        return False
    return torch.cuda.is_available()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[16, 64, 256, 1024, 4096, 16384, 65536])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    cuda = cuda_available()
    with tempfile.TemporaryDirectory() as tmp:
        write_identity_model(Path(tmp) / "repository")
        with started_server(Path(tmp) / "repository", Path(tmp) / "server.log") as (server, _), \
                Client(server.grpc_address, shm_threshold=None) as plain, \
                Client(server.grpc_address, shm_threshold=0) as shared:
            print(f"# {platform.node()}, {platform.processor() or platform.machine()}, "
                  f"{time.strftime('%Y-%m-%d')}; median of {args.repeat} round trips, identity model")
            rows = []
            for kib in args.sizes_kib:
                value = np.random.default_rng(0).standard_normal(kib * 256, dtype=np.float32)
                plain_ms, shm_ms = median_ms(plain, value, args.repeat), median_ms(shared, value, args.repeat)
                rows.append([f"{kib} KiB", f"{plain_ms:.2f}", f"{shm_ms:.2f}", f"{plain_ms / shm_ms:.2f}x"])
                if cuda:
                    import torch

                    rows[-1].append(f"{median_ms(shared, torch.from_numpy(value).cuda(), args.repeat):.2f}")
    print(markdown_table(["size", "gRPC messages (ms)", "system shm (ms)", "speed-up"]
                         + (["CUDA shm (ms)"] if cuda else []), rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
