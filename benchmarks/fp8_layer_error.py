"""Per-linear-layer error of FP8 and of bf16 on real activations of the FLUX transformer.

The measure of docs/benchmarks.md ("Accuracy: FP8 per linear layer"). One bf16 forward of the model as an engine
serves it (loaded as the server loads it, by the benchmark harness: projections fused; uncompiled, so that every
GEMM's input can be read) runs with every GEMM of the linear layers that an FP8 engine quantizes recorded (the
blocks' tensor-parallel linears; embedders, modulations and the output projection stay bf16). The single blocks'
output projection runs as two GEMMs, one per input part (attention, MLP), and is measured per part; its FP8 row
scales are then each part's own (an FP8 engine's cover the whole row). For each GEMM, with X its input in that
forward and W, b its bf16 weight and bias (the GELU or accumulation that follows left out):

    reference  y32  = X W^T + b in float32, of the same bf16 numbers
    bf16 error      = ||F.linear(X, W, b) - y32|| / ||y32||        (what a BF16 engine computes)
    fp8 error       = ||fp8_linear(X, Wq, s, b) - y32|| / ||y32||  (W in e4m3 with a scale per output row, X
                                                                     quantized per token: what an FP8 engine computes)

Every layer sees the activation the bf16 model gives it, so errors do not compound through the blocks as they do in
a whole forward. (An FP8 build quantizes W from the checkpoint's values; here from the bf16 weight, so both errors
are against the same reference.) Weights are random, with trained-like modulation scales (mdtriton.harness).

On GPUs of compute capability 8.9+, fp8_linear is the engine's (torch._scaled_mm). Elsewhere the quantization is
emulated (emulated_fp8_linear: the same e4m3 values and scales, the product in float32), so the script runs on CPU
with a small config:

    python benchmarks/fp8_layer_error.py                                   # FLUX.1-dev, 4,096+512 tokens, GPU 0
    python benchmarks/fp8_layer_error.py --preset tiny --image-tokens 64 --text-tokens 16 --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from mdtriton.engine.comm import Communicator
from mdtriton.engine.fp8 import Fp8Unsupported, check_fp8_device, fp8_linear, quantize_rows, quantize_weight
from mdtriton.engine.layers import ParallelLinear
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.families.flux.transformer import example_inputs
from mdtriton.harness import bench_engine, bench_weights, markdown_table, relative_error

BLOCK_KINDS = {"transformer_blocks": "double", "single_transformer_blocks": "single"}


def emulated_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """fp8_linear on any device: x quantized per token as fp8_linear does it, the e4m3 values of both operands
    multiplied in float32, the product scaled by both scales, the bias added and the sum rounded to x's dtype, as
    torch._scaled_mm does (its accumulation order aside)."""
    values, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = (values.float() @ weight.float().t()) * scale * weight_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def gemm_errors(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scaled_mm: bool) -> tuple[float, float]:
    """(fp8 error, bf16 error) of one GEMM on its input x, each against the float32 product (module docstring)."""
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    values, scale = quantize_weight(weight)
    fp8 = (fp8_linear if scaled_mm else emulated_fp8_linear)(x, values, scale, bias)
    return relative_error(fp8, exact), relative_error(F.linear(x, weight, bias), exact)


def gemm_name(name: str, layer: ParallelLinear, weight: torch.Tensor) -> str:
    """The layer's name; for a layer run one GEMM per input part (single blocks' proj_out), with the part's."""
    parts = getattr(layer, "segment_weights", None)
    if parts is None:
        return name
    return f"{name}.part{next(index for index, part in enumerate(parts) if part is weight)}"


def layer_kind(name: str) -> str:
    """A layer's name without its block's number: "transformer_blocks.3.attn.to_qkv" -> "double attn.to_qkv"."""
    blocks, _, rest = name.split(".", 2)
    return f"{BLOCK_KINDS[blocks]} {rest}"


def measure(config: dict, image_tokens: int, text_tokens: int, device: torch.device, scaled_mm: bool) -> list[dict]:
    """Each FP8-able linear layer's errors over one bf16 forward, in the order the forward runs them."""
    weights = bench_weights("flux", config, ParallelPlan(), 0, device, torch.bfloat16, None)
    engine = bench_engine("flux", config, Communicator.single(device), weights, "BF16", compiled=False)
    rows = []

    def recording(name: str, layer: ParallelLinear):
        linear = layer.linear

        def record_and_run(x, weight, bias, gelu=False, accumulate=None):
            fp8_error, bf16_error = gemm_errors(x, weight, bias, scaled_mm)
            gemm = gemm_name(name, layer, weight)
            rows.append({"name": gemm, "kind": layer_kind(gemm), "fp8_error": fp8_error, "bf16_error": bf16_error,
                         "ratio": fp8_error / bf16_error})
            return linear(x, weight, bias, gelu, accumulate)
        return record_and_run

    for name, layer in engine.module.named_modules():
        if isinstance(layer, ParallelLinear):
            layer.linear = recording(name, layer)  # every GEMM of a layer runs through its linear()
    engine.forward(example_inputs(config, text_tokens, image_tokens, torch.bfloat16))
    return rows


def summary(rows: list[dict]) -> dict[str, dict]:
    """Per layer kind: how many layers, and min / median / max over them of each error and of the ratio."""
    kinds = {}
    for kind in dict.fromkeys(row["kind"] for row in rows):
        of_kind = [row for row in rows if row["kind"] == kind]
        kinds[kind] = {"layers": len(of_kind)}
        for key in ("fp8_error", "bf16_error", "ratio"):
            values = [row[key] for row in of_kind]
            kinds[kind][key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return kinds


def table(kinds: dict[str, dict]) -> str:
    header = ["layer kind", "layers", "fp8 error min / median / max", "bf16 error min / median / max",
              "fp8 / bf16 min / median / max"]
    rows = []
    for kind, values in kinds.items():
        cells = [" / ".join(f"{values[key][stat]:.2e}" for stat in ("min", "median", "max"))
                 for key in ("fp8_error", "bf16_error")]
        cells.append(" / ".join(f"{values['ratio'][stat]:.1f}" for stat in ("min", "median", "max")))
        rows.append([kind, values["layers"], *cells])
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="flux.1-dev", choices=sorted(FLUX.presets()))
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--device", default="cuda:0", help="cuda:N (FP8 by torch._scaled_mm on 8.9+) or cpu")
    parser.add_argument("--output", type=Path, default=Path("bench-results/fp8_layer_error.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    # The float32 reference must be float32 GEMMs, not TF32 ones.
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        check_fp8_device(device)
        scaled_mm = True
    except Fp8Unsupported:
        scaled_mm = False
    config = FLUX.presets()[args.preset]
    rows = measure(config, args.image_tokens, args.text_tokens, device, scaled_mm)
    kinds = summary(rows)
    worst = max(rows, key=lambda row: row["ratio"])
    fp8 = "torch._scaled_mm" if scaled_mm else "emulated (e4m3 round trip, float32 product)"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.preset}, {args.image_tokens}+{args.text_tokens} tokens, {where}, FP8 by {fp8}: "
          f"{len(rows)} linear layers")
    print(table(kinds))
    print(f"largest fp8 / bf16 ratio: {worst['ratio']:.1f} ({worst['name']}: fp8 {worst['fp8_error']:.2e}, "
          f"bf16 {worst['bf16_error']:.2e})")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "preset": args.preset, "config": config, "image_tokens": args.image_tokens, "text_tokens": args.text_tokens,
        "device": where, "fp8": fp8, "kinds": kinds, "largest_ratio": worst, "layers": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
