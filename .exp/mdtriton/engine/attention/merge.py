"""Attention over several key blocks, combined: each block's output weighted by its share of the softmax, from the
blocks' log-sum-exps (the online softmax of ring attention, done once at the end over every block).

On CUDA one Triton kernel reads each block's output once and writes the result once (merging block by block in
PyTorch read and wrote a float32 copy of the output about four times per block: the ring's cost at image sizes);
elsewhere the same math in PyTorch, in float32.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch: the PyTorch implementation serves
    triton = None

ROWS_PER_PROGRAM = 16


def merge_blocks(outputs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outputs [N, B, S, H, D] (block n's attention output), lses [N, B, S, H] (float32 log-sum-exp of each query's
    scaled scores over block n; -inf for a block with no keys) -> the attention over all blocks [B, S, H, D], in
    outputs' dtype."""
    dim = outputs.shape[-1]
    if outputs.is_cuda and triton is not None and dim & (dim - 1) == 0:
        blocks = outputs.shape[0]
        rows = outputs[0].numel() // dim
        outputs, lses = outputs.contiguous(), lses.contiguous()
        merged = outputs.new_empty(outputs.shape[1:])
        _merge_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](merged, outputs, lses, rows, blocks, dim,
                                                              ROWS_PER_PROGRAM)
        return merged
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total).unsqueeze(-1)
    return (outputs.float() * weights).sum(dim=0).to(outputs.dtype)


if triton is not None:
    @triton.jit
    def _merge_kernel(merged_ptr, outputs_ptr, lses_ptr, rows, blocks: tl.constexpr, dim: tl.constexpr,
                      rows_per_program: tl.constexpr):
        row = tl.program_id(0) * rows_per_program + tl.arange(0, rows_per_program)
        valid = row < rows
        column = tl.arange(0, dim)
        largest = tl.full([rows_per_program], float("-inf"), tl.float32)
        for n in tl.static_range(blocks):
            largest = tl.maximum(largest, tl.load(lses_ptr + n * rows + row, mask=valid, other=float("-inf")))
        largest = tl.where(largest == float("-inf"), 0.0, largest)  # rows past the end: no NaN
        total = tl.zeros([rows_per_program], tl.float32)
        accumulated = tl.zeros([rows_per_program, dim], tl.float32)
        for n in tl.static_range(blocks):
            weight = tl.exp(tl.load(lses_ptr + n * rows + row, mask=valid, other=float("-inf")) - largest)
            block = tl.load(outputs_ptr + (n * rows + row)[:, None] * dim + column[None, :], mask=valid[:, None],
                            other=0.0)
            total += weight
            accumulated += weight[:, None] * block.to(tl.float32)
        total = tl.where(total == 0.0, 1.0, total)
        tl.store(merged_ptr + row[:, None] * dim + column[None, :],
                 (accumulated / total[:, None]).to(merged_ptr.dtype.element_ty), mask=valid[:, None])
