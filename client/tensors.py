"""Tensors on the client side: numpy or torch in, numpy out, and .npy / .safetensors files.

bf16: numpy has no bfloat16 of its own; tritonclient (2.73+) takes and returns `ml_dtypes.bfloat16`
arrays for Triton's BF16, and so do our .safetensors reads and writes. Torch bf16 tensors become such arrays (and back)
by reinterpreting their bits, without converting a value. Torch is imported only where a torch tensor is involved:
the client works without it.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import deserialize
from safetensors.numpy import save_file

NUMPY_TYPES = {
    "FP32": np.dtype(np.float32),
    "FP16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "INT64": np.dtype(np.int64),
    "INT32": np.dtype(np.int32),
}
# safetensors' data types as numpy's (safetensors.numpy's loader has no BF16: ml_dtypes gives it).
SAFETENSORS_TYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def as_numpy(value) -> np.ndarray:
    """numpy arrays pass through; torch tensors become numpy (bf16 as ml_dtypes.bfloat16, exactly);
    anything else (lists, scalars) goes through np.asarray."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # a torch tensor, without importing torch for clients that have none
        import torch

        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            # The same bits, read as ml_dtypes' bfloat16: no conversion (through float32 it took 1.6 ms for
            # FLUX.1-dev's 4 MiB of text embeddings).
            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    return np.asarray(value)


def to_torch(array: np.ndarray):
    """A numpy output as a torch tensor (bf16 stays bf16)."""
    import torch

    if array.dtype == NUMPY_TYPES["BF16"]:
        return torch.from_numpy(np.array(array).view(np.int16)).view(torch.bfloat16)  # a writable copy, same bits
    return torch.from_numpy(np.array(array))  # a writable copy


def is_cuda(value) -> bool:
    """Whether value is a torch tensor on a GPU."""
    return bool(getattr(value, "is_cuda", False))


def sendable(value, datatype: str):
    """value as Triton's datatype, contiguous: a torch tensor on a GPU stays there (CUDA shared memory can
    take it from there), anything else becomes a numpy array."""
    if is_cuda(value):
        from mdtriton.engine.dtypes import TORCH_DTYPES

        return value.to(TORCH_DTYPES[datatype]).contiguous()
    array = as_numpy(value)
    if datatype in NUMPY_TYPES and array.dtype != NUMPY_TYPES[datatype]:
        array = array.astype(NUMPY_TYPES[datatype])
    return np.ascontiguousarray(array)


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file by its name, or the one array of a .npy file under the key ''."""
    path = Path(path)
    if path.suffix == ".npy":
        return {"": np.load(path, allow_pickle=False)}
    if path.suffix == ".safetensors":
        tensors = {}
        for name, view in deserialize(path.read_bytes()):
            if view["dtype"] not in SAFETENSORS_TYPES:
                raise ValueError(f"{path}: tensor {name} is {view['dtype']}; send one of "
                                 f"{', '.join(SAFETENSORS_TYPES)}")
            tensors[name] = np.frombuffer(view["data"], SAFETENSORS_TYPES[view["dtype"]]).reshape(view["shape"])
        return tensors
    raise ValueError(f"{path}: tensors are read from .npy or .safetensors files")


def write_tensors(path: Path, tensors: dict[str, np.ndarray]) -> list[Path]:
    """Save tensors into one .safetensors file (bf16 kept), or as NAME.npy files in the directory path.

    .npy has no bf16, so bf16 outputs are written there as float32 (exactly the same values).
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({name: np.ascontiguousarray(array) for name, array in tensors.items()}, path)
        return [path]
    path.mkdir(parents=True, exist_ok=True)
    written = []
    for name, array in tensors.items():
        if array.dtype == NUMPY_TYPES["BF16"]:
            array = array.astype(np.float32)
        np.save(path / f"{name}.npy", array)
        written.append(path / f"{name}.npy")
    return written
