"""FLUX's q/k/v step (mdtriton.families.flux.qkv): the Triton kernel on a GPU computes what the PyTorch
implementation does, for double blocks (text first) and single blocks, tensor- and context-parallel shapes
alike (any heads, any split of the tokens, none of a stream on this rank); packed for the Ulysses exchange, the
kernel writes the same q, k and v where ulysses.pack_heads would copy them (on CPU the op is pack_heads itself)."""

from __future__ import annotations

import pytest
import torch

from mdtriton.engine.attention.ulysses import pack_heads
from mdtriton.families.flux.layers import rotary_embedding
from mdtriton.families.flux.qkv import stream_qkv

# (batch, text tokens, image tokens, heads): FLUX.1-dev's heads, a tensor-parallel rank's, odd lengths, a rank
# holding no text tokens.
SHAPES = [(1, 512, 4096, 24), (2, 7, 61, 12), (1, 0, 33, 3)]
AXES = [16, 56, 56]  # FLUX's head_dim 128


def pytorch_joint_qkv(qkv, weights, text_qkv, cos, sin, eps):
    """The PyTorch implementation, stream by stream (what the op runs on CPU)."""
    text_len = text_qkv.shape[1]
    image = stream_qkv(qkv, weights[0], weights[1], eps, cos[text_len:], sin[text_len:])
    text = stream_qkv(text_qkv, weights[2], weights[3], eps, cos[:text_len], sin[:text_len])
    return [torch.cat((t, i), dim=1) for t, i in zip(text, image)]


def projections(device: str, dtype: torch.dtype, batch: int, text_len: int, image_len: int, heads: int) -> tuple:
    """Random fused projection outputs of both streams, their norms' weights and rotary tables: joint_qkv's inputs."""
    generator = torch.Generator(device).manual_seed(0)
    head_dim = sum(AXES)

    def random(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    qkv, text_qkv = random(batch, image_len, 3 * heads * head_dim), random(batch, text_len, 3 * heads * head_dim)
    weights = [1 + 0.1 * random(head_dim) for _ in range(4)]
    ids = torch.randint(0, 64, (text_len + image_len, 3), generator=generator, device=device)
    return qkv, text_qkv, weights, *rotary_embedding(ids, AXES)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 3])
def test_packed_for_ulysses_they_are_what_the_exchange_would_copy(ranks):
    """(On CPU the op is pack_heads of joint_qkv's output.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    qkv, text_qkv, weights, cos, sin = projections("cuda", torch.float32, 2, 7, 61, 12)
    for text, w_text, first in ((text_qkv, weights[2:], 0), (None, [None, None], 7)):
        q, k, v = torch.ops.mdtriton.joint_qkv(qkv, weights[0], weights[1], text, *w_text, cos[first:], sin[first:],
                                               1e-6)
        send = torch.ops.mdtriton.packed_qkv(qkv, weights[0], weights[1], text, *w_text, cos[first:], sin[first:],
                                             1e-6, ranks)
        expected = pack_heads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ranks)
        assert send.shape == expected.shape == (ranks, 2, 68 - first, 3 * 12 // ranks, sum(AXES))
        assert torch.equal(send, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, text_len, image_len, heads", SHAPES)
def test_the_gpu_kernel_computes_what_pytorch_does(batch, text_len, image_len, heads, dtype):
    qkv, text_qkv, weights, cos, sin = projections("cuda", dtype, batch, text_len, image_len, heads)
    head_dim = sum(AXES)
    got = torch.ops.mdtriton.joint_qkv(qkv, weights[0], weights[1], text_qkv, weights[2], weights[3], cos, sin,
                                       1e-6)
    expected = pytorch_joint_qkv(qkv, weights, text_qkv, cos, sin, 1e-6)
    for name, a, b in zip("qkv", got, expected):
        assert a.shape == b.shape == (batch, text_len + image_len, heads, head_dim) and a.is_contiguous()
        if name == "v":
            assert torch.equal(a, b)
        elif dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:  # the norm's output rounded once here, where PyTorch rounds it twice (normed, then times weight)
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 4e-3, name
    single = torch.ops.mdtriton.joint_qkv(qkv, weights[0], weights[1], None, None, None, cos[text_len:],
                                          sin[text_len:], 1e-6)
    assert all(torch.equal(a, b[:, text_len:]) for a, b in zip(single, got))
