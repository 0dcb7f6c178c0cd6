"""Adapters on a compiled GPU engine (what a served rank runs), bf16 and FP8: merged into the weights that the compiled
blocks and the CUDA graphs read in place, they change the answer as the uncompiled module with the same merge does,
nothing recompiles or is captured again after a switch, and the base answer comes back bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from mdtriton.build_tools.engine_builder import random_shard
from mdtriton.engine.comm import Communicator
from mdtriton.engine.layers import ParallelLinear
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.harness import bench_engine, flux_inputs, relative_error
from mdtriton.lora.adapter_file import Factors, write_adapter
from mdtriton.lora.weights import AdapterWeights


def block_factors(module: nn.Module, seed: int, rank: int) -> dict[str, Factors]:
    """Random factors of every linear layer of the blocks, under diffusers' names (module: unjoined, one rank)."""
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for name, layer in module.named_modules():
        if isinstance(layer, (nn.Linear, ParallelLinear)) and "blocks." in name:
            out_features, in_features = layer.weight.shape
            factors[name] = Factors(torch.randn(rank, in_features, generator=generator) / in_features**0.5,
                                    torch.randn(out_features, rank, generator=generator) * 0.05, 1.0)
    return factors


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_compiled_engine_takes_adapters_without_recompiling(tmp_path, quantization):
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    device = torch.device("cuda", 0)
    config = FLUX.default_config()
    with torch.device("meta"):
        skeleton = FLUX.new_module(config, Communicator(ParallelPlan(), 0, torch.device("meta")))
    for name, seed in (("a", 1), ("b", 2)):
        write_adapter(tmp_path / f"{name}.safetensors", block_factors(skeleton, seed, rank=4))

    def engine(compiled: bool):
        weights = random_shard("flux", config, ParallelPlan(), 0, seed=0, device=device, dtype=torch.bfloat16,
                               quantization=quantization)
        made = bench_engine("flux", config, Communicator.single(device), weights, "BF16", quantization, compiled)
        return made, AdapterWeights(made.module, tmp_path, 1 << 30, torch.bfloat16)

    (compiled, merged), (eager, eager_merged) = engine(True), engine(False)
    short, long = flux_inputs(config, 7, 30, device), flux_inputs(config, 16, 8200, device)  # graphed, not graphed
    base = {size: compiled.forward(inputs)["sample"].clone() for size, inputs in (("short", short), ("long", long))}
    graphs, captured = counters["stats"]["unique_graphs"], len(compiled.run.graphs["forward"].graphs)
    with torch.compiler.set_stance("fail_on_recompile"):  # raises if anything would recompile
        for scales in ({"a": 1.0}, {"b": 0.5, "a": -1.0}, {"a": 1.0}):
            merged.activate(scales)
            eager_merged.activate(scales)
            for inputs in (short, long):
                answer, expected = compiled.forward(inputs)["sample"], eager.forward(inputs)["sample"]
                assert relative_error(answer, expected) < 3e-2  # compiled against eager, in bf16
                assert relative_error(answer, base["short" if inputs is short else "long"]) > 5e-2
        merged.activate({})
        for size, inputs in (("short", short), ("long", long)):
            assert torch.equal(compiled.forward(inputs)["sample"], base[size])
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(compiled.run.graphs["forward"].graphs) == captured
