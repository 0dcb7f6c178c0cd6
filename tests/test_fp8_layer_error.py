"""benchmarks/fp8_layer_error.py: its FP8 emulation (what it measures on CPU) and a run on a tiny FLUX."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.fp8_layer_error import emulated_fp8_linear, main
from mdtriton.engine.fp8 import FP8_DTYPE, FP8_MAX, fp8_linear, quantize_weight
from mdtriton.harness import relative_error


def e4m3_rows(rows: int, columns: int, seed: int) -> torch.Tensor:
    """bf16 rows of e4m3 values, row r scaled by 2^-(r % 5) and holding FP8_MAX * 2^-(r % 5) once: quantizing a
    row (scale = its largest magnitude / FP8_MAX, a power of two) loses nothing."""
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(rows, columns, generator=generator) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    values[:, 0] = FP8_MAX
    return (values * 2.0 ** -(torch.arange(rows) % 5)[:, None]).to(torch.bfloat16)


def test_the_emulation_is_exact_where_e4m3_holds_the_operands():
    """With operands that quantize losslessly (scales of different powers of two per token and per output row),
    the emulation equals the float32 product rounded to bf16: its scales go on the right axes."""
    x, weight, bias = e4m3_rows(6, 32, seed=0), e4m3_rows(10, 32, seed=1), torch.randn(10).to(torch.bfloat16)
    values, scale = quantize_weight(weight)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
    assert torch.equal(emulated_fp8_linear(x, values, scale, bias), expected)


def test_a_tiny_flux_gives_every_fp8_layer_an_fp8_error_above_bf16s(tmp_path):
    output = tmp_path / "errors.json"
    main(["--preset", "tiny", "--image-tokens", "16", "--text-tokens", "8", "--device", "cpu", "--output", str(output)])
    result = json.loads(output.read_text())
    assert result["fp8"].startswith("emulated")
    # Per double block: fused q/k/v and output projection of each stream, and each stream's two MLP layers;
    # per single block: fused q/k/v, the MLP's first layer, and the output projection's two parts (tiny: 2 blocks
    # of each kind).
    assert len(result["layers"]) == 2 * 8 + 2 * 4
    layers = {kind: values["layers"] for kind, values in result["kinds"].items()}
    assert layers["single proj_out.part0"] == layers["single proj_out.part1"] == 2
    for layer in result["layers"]:
        assert 1e-4 < layer["bf16_error"] < 1e-2 < layer["fp8_error"] < 1e-1, layer


@pytest.mark.gpu
def test_the_emulation_agrees_with_scaled_mm():
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    values, scale = quantize_weight(torch.randn(512, 256, device="cuda", dtype=torch.bfloat16))
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    # The same e4m3 operands and scales: only the accumulation order and the output's rounding may differ.
    assert relative_error(fp8_linear(x, values, scale, bias), emulated_fp8_linear(x, values, scale, bias)) < 5e-3
