"""Wan's q/k/v step (mdtriton.families.wan.qkv): the Triton kernel on a GPU computes what the PyTorch implementation
(the eager block's norm and rotation) does, for tensor- and context-parallel shapes alike; packed for the Ulysses
exchange, q, k and v are where ulysses.pack_heads would copy them."""

from __future__ import annotations

import pytest
import torch

from mdtriton.engine.attention.ulysses import pack_heads
from mdtriton.families.wan.qkv import norm_rotate

# (batch, tokens, heads, head_dim, features): Wan 14B's 40 heads on one of 4 context-parallel ranks at 480p, a
# tensor-parallel rank's 20 of them (normed over all 5,120 features), odd sizes.
SHAPES = [(1, 8190, 40, 128, 5120), (1, 300, 20, 128, 5120), (2, 37, 6, 12, 72)]


def inputs(device: str, dtype: torch.dtype, batch: int, tokens: int, heads: int, head_dim: int, features: int):
    """Random projections q, k, v [B, S, H * D], their sums of squares over `features` (as if the other tensor-
    parallel ranks' columns were like these), the norms' weights and rotary tables with pairs repeated."""
    generator = torch.Generator(device).manual_seed(0)

    def random(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    q, k, v = (random(batch, tokens, heads * head_dim) for _ in range(3))
    q_squares, k_squares = (x.float().pow(2).sum(-1, keepdim=True) * features / x.shape[-1] for x in (q, k))
    weights = [1 + 0.1 * random(heads * head_dim) for _ in range(2)]
    angles = torch.rand(tokens, head_dim // 2, generator=generator, device=device).repeat_interleave(2, dim=1) * 6.28
    return q, k, v, q_squares, k_squares, *weights, angles.cos(), angles.sin(), features, 1e-6, head_dim


# On CPU the packed op is qk's result copied by pack_heads (its implementation): the GPU kernel is what this checks.
@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 3])
def test_packed_for_ulysses_they_are_what_the_exchange_would_copy(ranks):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = inputs("cuda", torch.float32, 2, 37, 6, 12, 72)
    q, k = torch.ops.mdtriton.wan_qk(*args[:2], *args[3:])
    v = args[2].unflatten(-1, (6, 12))
    send = torch.ops.mdtriton.wan_packed_qkv(*args, ranks)
    expected = pack_heads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ranks)
    assert send.shape == expected.shape == (ranks, 2, 37, 3 * 6 // ranks, 12)
    assert torch.equal(send, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, tokens, heads, head_dim, features", SHAPES)
def test_the_gpu_kernel_computes_what_pytorch_does(batch, tokens, heads, head_dim, features, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k, v, q_squares, k_squares, q_weight, k_weight, cos, sin, _, eps, _ = inputs(
        "cuda", dtype, batch, tokens, heads, head_dim, features)
    got = torch.ops.mdtriton.wan_qk(q, k, q_squares, k_squares, q_weight, k_weight, cos, sin, features, eps, head_dim)
    for name, a, x, squares, weight in (("q", got[0], q, q_squares, q_weight), ("k", got[1], k, k_squares, k_weight)):
        b = norm_rotate(x, squares, weight, features, eps, cos, sin, head_dim)
        assert a.shape == b.shape == (batch, tokens, heads, head_dim) and a.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:  # bf16: the same roundings, fused multiply-adds aside
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-3, name
