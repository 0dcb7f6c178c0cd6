"""Wan's q/k/v heads (mdtriton.families.wan.qkv): the Triton kernel on a GPU computes what the PyTorch implementation
(the eager block's norm and rotation) does, for tensor- and context-parallel shapes alike (head_dim not a power of
two too: the tiny test model's); laid out for the Ulysses exchange, the heads are where ulysses.pack_heads would copy
them."""

from __future__ import annotations

import pytest
import torch

from mdtriton.engine.attention.ulysses import pack_heads
from mdtriton.families.wan.qkv import norm_rotate

# (batch, tokens, heads, head_dim, features): Wan 14B's 40 heads on one of 4 context-parallel ranks at 480p, a
# tensor-parallel rank's 20 of them (normed over all 5,120 features), odd sizes and the tiny model's head_dim 12.
SHAPES = [(1, 8190, 40, 128, 5120), (1, 300, 20, 128, 5120), (2, 37, 6, 12, 72)]

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def needs_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def inputs(dtype: torch.dtype, batch: int, tokens: int, heads: int, head_dim: int, features: int):
    """Random projections q, k, v [B, S, H * D] on the GPU, q's and k's sums of squares over `features` (as if the
    other tensor-parallel ranks' columns were like these), the norms' weights and Wan's kind of rotary tables (each
    pair of channels alike)."""
    generator = torch.Generator("cuda").manual_seed(0)

    def random(*shape):
        return torch.randn(*shape, generator=generator, device="cuda").to(dtype)

    q, k, v = (random(batch, tokens, heads * head_dim) for _ in range(3))
    squares = [x.float().pow(2).sum(-1, keepdim=True) * features / x.shape[-1] for x in (q, k)]
    weights = [1 + 0.1 * random(heads * head_dim) for _ in range(2)]
    angles = torch.rand(tokens, head_dim // 2, generator=generator, device="cuda").repeat_interleave(2, dim=1) * 6.28
    return q, k, v, squares, weights, angles.cos(), angles.sin()


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_heads_for_ulysses_are_what_the_exchange_would_copy(ranks):
    q, k, v, squares, weights, cos, sin = inputs(torch.float32, 2, 37, 6, 12, 72)
    rotary = (cos, sin, 72, 1e-6, 12)
    sent = [torch.ops.mdtriton.wan_norm_rotate_heads(x, s, w, *rotary, ranks) for x, s, w in zip((q, k), squares,
                                                                                               weights)]
    sent.append(torch.ops.mdtriton.wan_packed_heads(v, 12, ranks))
    q, k = (torch.ops.mdtriton.wan_norm_rotate_heads(x, s, w, *rotary, 1)[0] for x, s, w in zip((q, k), squares,
                                                                                              weights))
    expected = pack_heads(q.transpose(1, 2), k.transpose(1, 2), v.unflatten(-1, (6, 12)).transpose(1, 2), ranks)
    assert torch.equal(torch.cat(sent, dim=3), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, tokens, heads, head_dim, features", SHAPES)
def test_the_gpu_kernel_computes_what_pytorch_does(batch, tokens, heads, head_dim, features, dtype):
    q, k, _, squares, weights, cos, sin = inputs(dtype, batch, tokens, heads, head_dim, features)
    for name, x, x_squares, weight in zip("qk", (q, k), squares, weights):
        got = torch.ops.mdtriton.wan_norm_rotate_heads(x, x_squares, weight, cos, sin, features, 1e-6, head_dim, 1)
        expected = norm_rotate(x, x_squares, weight, features, 1e-6, cos, sin, head_dim)
        assert got.shape == (1, *expected.shape) and got.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)
        else:  # bf16: the same roundings, fused multiply-adds aside
            assert ((got[0].float() - expected.float()).norm() / expected.float().norm()).item() < 2e-3, name
