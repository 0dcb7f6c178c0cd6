"""bf16 tensors cross into numpy (ml_dtypes.bfloat16, what tritonclient sends) and back with every bit kept
(NaN payloads too, which a conversion through float32 would change)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from mdtriton.client.tensors import as_numpy, to_torch


def test_bf16_round_trips_bit_for_bit():
    tensor = torch.randn(4, 6).to(torch.bfloat16)
    tensor[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    for value in (tensor, tensor[:, ::2]):  # contiguous, and not
        array = as_numpy(value)
        assert array.dtype == ml_dtypes.bfloat16 and array.shape == tuple(value.shape)
        assert np.array_equal(array.view(np.int16), value.view(torch.int16).numpy())
        back = to_torch(array)
        assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), value.view(torch.int16))
        back.add_(1)  # a copy of its own: writable, and the array is not changed
        assert np.array_equal(array.view(np.int16), value.view(torch.int16).numpy())
