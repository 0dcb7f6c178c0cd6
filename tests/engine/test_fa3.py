"""FlashAttention-3 as the engine's attention on Hopper (mdtriton.engine.attention.fa3): the engine's attention
functions give float32 attention's answer to bf16 rounding, in the layouts the blocks and the CP methods pass
(views of the q/k/v kernel's [B, S, H, D] output, key slices cut at valid_len), with the right log-sum-exp, also
written into given memory with multiprocessors left to a transfer; and
where it cannot run, the engine says why and keeps cuDNN's SDPA."""

from __future__ import annotations

import pytest
import torch

from mdtriton.engine.attention import fa3, local
from mdtriton.harness import relative_error


def test_fa3_is_not_used_off_cuda_and_says_why():
    assert "CUDA" in fa3.unavailable_reason(torch.device("cpu"))
    assert not local.uses_fa3(torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16))


def float32_attention(q, k, v):
    scores = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(scores, dim=-1) @ v.float(), scores.logsumexp(dim=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, tokens, valid_len, heads", [(1, 4608, 4608, 24), (2, 301, 250, 12)])
def test_engine_attention_on_hopper_is_fa3_and_right(batch, tokens, valid_len, heads):
    device = torch.device("cuda")
    if not fa3.available(device):
        pytest.skip(f"FlashAttention-3 not usable here: {fa3.unavailable_reason(device)}")
    generator = torch.Generator("cuda").manual_seed(0)
    # As the q/k/v kernel writes them: [B, S, H, D] contiguous, seen by the attention functions as [B, H, S, D].
    q, k, v = (torch.randn(batch, tokens, heads, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
               .transpose(1, 2) for _ in range(3))
    assert local.uses_fa3(q)
    expected, expected_lse = float32_attention(q, k[:, :, :valid_len], v[:, :, :valid_len])
    got = local.attention(q, k, v, None, valid_len)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert relative_error(got, expected) < 1e-2
    out, lse = local.attention_with_lse(q, k[:, :, :valid_len], v[:, :, :valid_len])
    assert torch.equal(out, got)
    assert relative_error(lse, expected_lse) < 1e-4
    # As a ring step calls it: written into given memory, with multiprocessors left to a transfer beside it.
    memory = torch.full((batch, tokens, heads, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    written, written_lse = local.attention_with_lse(q, k[:, :, :valid_len], v[:, :, :valid_len], out=memory,
                                                    nccl_sms=local.RING_NCCL_SMS)
    assert written.data_ptr() == memory.data_ptr()
    assert torch.equal(written, got) and torch.equal(written_lse, lse)
