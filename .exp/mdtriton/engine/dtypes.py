"""Triton data type names <-> torch dtypes."""

import torch

TORCH_DTYPES = {
    "FP32": torch.float32,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "INT64": torch.int64,
    "INT32": torch.int32,
    "UINT8": torch.uint8,
}
TRITON_TYPES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
