"""Prompts as tensors. Clients send them as Triton's BYTES (TYPE_STRING): one UTF-8 string per prompt. The stub that
receives a request turns them into one row of UTF-8 bytes per prompt, zero-padded to the longest (UINT8 [batch,
bytes]: `text_rows`), which travel to the rank workers and between ranks like any other tensor (BYTES have no
DLPack) and which the pipeline reads back (`read_prompts`). UTF-8 encodes no character but U+0000 with a zero byte,
so the padding is unambiguous for prompts without NUL characters (which are refused).

(Triton 2.51's Python-backend stub can read BYTES only under numpy 1.x: mdtriton.stub_environment.)
"""

from __future__ import annotations

import numpy as np
import torch


def prompt_tensor(prompts: list[str], name: str = "prompt") -> np.ndarray:
    """The UINT8 [batch, bytes] tensor of prompts (UTF-8, zero-padded to the longest, at least one byte wide);
    ValueError naming the input `name` and the prompt if one holds a NUL character."""
    encoded = [prompt.encode("utf-8") for prompt in prompts]
    for index, text in enumerate(encoded):
        if b"\0" in text:
            raise ValueError(f"{name}[{index}] holds a NUL character (U+0000); remove it")
    rows = np.zeros((len(encoded), max([1] + [len(text) for text in encoded])), np.uint8)
    for row, text in zip(rows, encoded):
        row[:len(text)] = np.frombuffer(text, np.uint8)
    return rows


def text_rows(values, name: str) -> torch.Tensor:
    """The UINT8 rows (prompt_tensor) of the BYTES elements `values` of input `name`; ValueError, naming the input and
    what to send, if one is not UTF-8 or holds a NUL character."""
    prompts = []
    for index, value in enumerate(values):
        try:
            prompts.append(bytes(value).decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{name}[{index}] is not UTF-8 ({error.reason} at byte {error.start}); send each prompt "
                             "as UTF-8 text") from None
    return torch.from_numpy(prompt_tensor(prompts, name))


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
