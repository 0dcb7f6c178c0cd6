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


def test_safetensors_files_are_read_and_written_without_torch_bit_for_bit(tmp_path):
    """The client's .safetensors reads and writes go through numpy (ml_dtypes for bf16): a file torch wrote reads
    with every bit, and what the client writes reads back in torch the same."""
    from safetensors.torch import load_file, save_file

    from mdtriton.client.tensors import read_tensors, write_tensors

    tensors = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "fp32": torch.randn(2, 2), "ids": torch.arange(4)}
    tensors["bf16"][0, 0] = float("nan")
    save_file(tensors, tmp_path / "in.safetensors")
    arrays = read_tensors(tmp_path / "in.safetensors")
    assert arrays["bf16"].dtype == ml_dtypes.bfloat16 and arrays["ids"].dtype == np.int64
    assert np.array_equal(arrays["bf16"].view(np.int16), tensors["bf16"].view(torch.int16).numpy())
    write_tensors(tmp_path / "out.safetensors", arrays)
    back = load_file(tmp_path / "out.safetensors")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8))
