"""Prompts travel from the receiving stub to the ranks as zero-padded UTF-8 rows (UINT8 [batch, bytes]): BYTES have
no DLPack."""

from __future__ import annotations

import pytest
import torch

from mdtriton.pipeline.prompts import prompt_tensor, read_prompts


def test_prompts_round_trip_through_utf8_rows():
    prompts = ["a cat holding a sign that says hello world", "ein Hund, grün 🐕", ""]
    rows = prompt_tensor(prompts)
    assert rows.dtype.name == "uint8" and rows.shape == (3, len(prompts[0]))
    assert read_prompts(torch.from_numpy(rows), "prompt") == prompts


def test_bytes_that_are_not_utf8_are_refused_saying_what_to_send():
    rows = torch.tensor([[104, 105, 0], [0xFF, 0xFE, 0]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"prompt\[1\] is not UTF-8.*send each prompt as its UTF-8 bytes"):
        read_prompts(rows, "prompt")


def test_a_nul_character_is_refused():
    with pytest.raises(ValueError, match="NUL"):
        prompt_tensor(["a\0b"])
