"""Send inference requests to an mdtriton model over gRPC (tritonclient), numpy or torch in and out.

bf16: numpy has no bfloat16 of its own; tritonclient (2.73+) takes and returns `ml_dtypes.bfloat16`
arrays for Triton's BF16. Torch bf16 tensors are converted to that exactly (bf16 -> float32 -> bf16
loses nothing).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

NUMPY_TYPES = {
    "FP32": np.dtype(np.float32),
    "FP16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "INT64": np.dtype(np.int64),
    "INT32": np.dtype(np.int32),
}


class ClientError(Exception):
    """A request that failed; the message is the server's (or ours) in one line."""


def as_numpy(value) -> np.ndarray:
    """numpy arrays pass through; torch tensors become numpy (bf16 as ml_dtypes.bfloat16, exactly)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # a torch tensor, without importing torch for clients that have none
        import torch

        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.float().numpy().astype(ml_dtypes.bfloat16)
        return tensor.numpy()
    return np.asarray(value)


def to_torch(array: np.ndarray):
    """A numpy output as a torch tensor (bf16 stays bf16)."""
    import torch

    if array.dtype == NUMPY_TYPES["BF16"]:
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(array))  # a writable copy


class Client:
    """A gRPC connection to one Triton server."""

    def __init__(self, url: str, timeout: float | None = None):
        self.url = url
        self.timeout = timeout
        self._client = grpcclient.InferenceServerClient(url)
        self._metadata: dict[tuple[str, str], dict] = {}

    def metadata(self, model: str, version: str = "") -> dict:
        """The model's metadata (inputs, outputs, versions) as a dict."""
        key = (model, version)
        if key not in self._metadata:
            self._metadata[key] = self._call(self._client.get_model_metadata, model, version, as_json=True)
        return self._metadata[key]

    def infer(self, model: str, inputs: dict, version: str = "", timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run the model on inputs (name -> numpy array or torch tensor); return its outputs as numpy arrays.

        Each input is converted to the data type the model declares (e.g. float32 -> BF16).
        """
        declared = {spec["name"]: spec["datatype"] for spec in self.metadata(model, version)["inputs"]}
        unknown = sorted(set(inputs) - set(declared))
        if unknown:
            raise ClientError(f"model {model!r} has no input(s) {unknown}; its inputs are {sorted(declared)}")
        infer_inputs = []
        for name, value in inputs.items():
            array = as_numpy(value)
            target = NUMPY_TYPES.get(declared[name])
            if target is not None and array.dtype != target:
                array = array.astype(target)
            infer_input = grpcclient.InferInput(name, list(array.shape), declared[name])
            infer_input.set_data_from_numpy(np.ascontiguousarray(array))
            infer_inputs.append(infer_input)
        result = self._call(self._client.infer, model, infer_inputs, model_version=version,
                            client_timeout=timeout or self.timeout)
        return {output["name"]: result.as_numpy(output["name"]) for output in result.get_response(as_json=True)["outputs"]}

    def _call(self, method, *args, **kwargs):
        try:
            return method(*args, **kwargs)
        except InferenceServerException as error:
            status = error.status() or "error"
            raise ClientError(f"{status}: {error.message()}") from None

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
