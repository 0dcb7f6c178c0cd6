"""The one-pass producers of linear-layer inputs (mdtriton.engine.fused_activations): on a GPU the Triton kernels
compute what the PyTorch implementations (the CPU path) do, for FLUX.1-dev's widths, a tensor-parallel rank's,
odd ones, several samples, and strided modulations (chunks of one modulation output, as the blocks pass them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mdtriton.engine.fp8 import FP8_MAX, quantize_rows
from mdtriton.engine.fused_activations import (attention_and_gelu_to_fp8, modulate_reference, modulated_layer_norm,
                                               modulated_layer_norm_fp8, rows_to_fp8)
from mdtriton.harness import relative_error

# (batch, tokens, width)
SHAPES = [(1, 4608, 3072), (2, 37, 1536), (3, 5, 100)]


def random(*shape, generator, scale=1.0):
    return (scale * torch.randn(*shape, generator=generator, device="cuda")).to(torch.bfloat16)


def assert_same_quantization(values, scales, expected_values, expected_scales):
    """The kernel rounds once before quantizing, PyTorch's path after every step (up to three for the modulated
    norm), so some elements land a bf16 step or two apart: the scales agree to that, and the e4m3 values dequantize
    to within a rounding."""
    assert values.dtype == expected_values.dtype and scales.shape == expected_scales.shape
    torch.testing.assert_close(scales, expected_scales, rtol=2e-2, atol=0)
    assert values.float().abs().max() <= FP8_MAX
    assert relative_error(values.float() * scales, expected_values.float() * expected_scales) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("batch, tokens, width", SHAPES)
def test_the_modulated_layer_norm_kernel_computes_what_pytorch_does(batch, tokens, width):
    generator = torch.Generator("cuda").manual_seed(0)
    x = random(batch, tokens, width, generator=generator, scale=3.0)
    shift, scale, _ = random(batch, 3 * width, generator=generator, scale=0.5).chunk(3, dim=1)  # strided views
    expected = modulate_reference(x, shift, scale)
    got = modulated_layer_norm(x, shift, scale)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert relative_error(got, expected) < 4e-3
    rows = modulated_layer_norm_fp8(x, shift, scale)
    assert rows.dtype == x.dtype
    assert_same_quantization(rows.values, rows.scale, *quantize_rows(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("batch, tokens, width", SHAPES + [(1, 4608, 12288)])
def test_the_fp8_row_kernel_computes_what_pytorch_does(batch, tokens, width, gelu):
    generator = torch.Generator("cuda").manual_seed(1)
    x = random(batch, tokens, width, generator=generator, scale=2.0)
    expected = F.gelu(x, approximate="tanh") if gelu else x
    rows = rows_to_fp8(x, gelu=gelu)
    assert rows.values.shape == x.shape and rows.scale.shape == (batch, tokens, 1)
    assert_same_quantization(rows.values, rows.scale, *quantize_rows(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("batch, tokens, attention_width, mlp_width", [(1, 4608, 3072, 12288), (2, 9, 1536, 6144),
                                                                       (1, 3, 100, 30)])
def test_the_joint_fp8_kernel_quantizes_attention_and_gelu_with_one_scale_per_row(batch, tokens, attention_width,
                                                                                  mlp_width):
    generator = torch.Generator("cuda").manual_seed(2)
    attention = random(batch, tokens, attention_width, generator=generator)
    mlp = random(batch, tokens, mlp_width, generator=generator, scale=3.0)
    rows = attention_and_gelu_to_fp8(attention, mlp)
    assert rows.values.shape == (batch, tokens, attention_width + mlp_width) and rows.dtype == attention.dtype
    expected = torch.cat((attention, F.gelu(mlp, approximate="tanh")), dim=-1)
    assert_same_quantization(rows.values, rows.scale, *quantize_rows(expected))
