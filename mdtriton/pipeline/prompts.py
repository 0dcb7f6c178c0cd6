"""Prompts as tensors: one row of UTF-8 bytes per prompt, zero-padded to the longest (UINT8 [batch, bytes]).

Triton's BYTES type would be the natural one, but the Python backend of Triton 2.51 cannot take a BYTES
input under numpy 2: its stub unpacks the request's strings through numpy before `execute` runs, gets
garbage, and dies (the instance is lost). UINT8 tensors travel by DLPack like every other input, and
between ranks like any other tensor. UTF-8 encodes no character but U+0000 with a zero byte, so the
padding is unambiguous for prompts without NUL characters (which are refused).
"""

from __future__ import annotations

import numpy as np
import torch


def prompt_tensor(prompts: list[str]) -> np.ndarray:
    """The UINT8 [batch, bytes] tensor of prompts (UTF-8, zero-padded to the longest, at least one byte wide)."""
    encoded = [prompt.encode("utf-8") for prompt in prompts]
    if any(b"\0" in text for text in encoded):
        raise ValueError("a prompt holds a NUL character (U+0000); remove it")
    rows = np.zeros((len(encoded), max([1] + [len(text) for text in encoded])), np.uint8)
    for row, text in zip(rows, encoded):
        row[:len(text)] = np.frombuffer(text, np.uint8)
    return rows


def read_prompts(tensor: torch.Tensor, name: str) -> list[str]:
    """The prompts of a UINT8 [batch, bytes] tensor; ValueError, saying what to send, if a row is not UTF-8."""
    prompts = []
    for index, row in enumerate(tensor.cpu()):
        data = bytes(row.tolist()).rstrip(b"\0")
        try:
            prompts.append(data.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{name}[{index}] is not UTF-8 ({error.reason} at byte {error.start}); send each prompt "
                             "as its UTF-8 bytes, one zero-padded row per prompt (UINT8 [batch, bytes])") from None
    return prompts
