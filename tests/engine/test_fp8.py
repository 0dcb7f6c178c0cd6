"""FP8 engines: e4m3 weights with row scales made per rank at build time, per-token activation scales at run
time, and clear refusals where FP8 cannot run (CPU instances, GPUs older than compute capability 8.9)."""

from __future__ import annotations

import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_shard, random_weights
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.fp8 import FP8_DTYPE, Fp8Unsupported, check_fp8_device, fp8_linear, quantize_weight
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.memory import rank_weight_bytes
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.harness import relative_error

GIB = 1 << 30


def test_fp8_linear_is_the_product_within_e4m3_rounding():
    # On the GPU where there is one (FP8 engines run there), with bf16 activations as an engine's: torch 2.11's CPU
    # backend scales FP8 GEMMs per tensor only, and refuses these per-row scales (torch 2.13's runs them), and its
    # CUDA backend adds no bias to a float32 output.
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    generator = torch.Generator().manual_seed(0)
    weight, x, bias = (torch.randn(shape, generator=generator).to(device) for shape in ((96, 64), (3, 5, 64), (96,)))
    values, scale = quantize_weight(weight)
    assert values.dtype == FP8_DTYPE and scale.shape == (96,)
    assert relative_error(values.float() * scale[:, None], weight) < 0.04  # 3 mantissa bits: ~2.5% per element
    out = fp8_linear(x.to(dtype), values, scale, bias.to(dtype))
    assert out.shape == (3, 5, 96) and out.dtype == dtype
    assert relative_error(out.float(), x @ weight.T + bias) < 0.05
    # A zero row (all-zero activations happen: padding) gives zeros, not NaN.
    zeros = torch.zeros(2, 64, device=device, dtype=dtype)
    assert torch.equal(fp8_linear(zeros, values, scale, None), torch.zeros(2, 96, device=device, dtype=dtype))


def test_each_rank_quantizes_its_own_shard():
    config = FLUX.default_config()
    full = random_weights("flux", config, 5)
    plan = ParallelPlan(tp_size=2)
    shards = [random_shard("flux", config, plan, rank, seed=5, quantization="fp8") for rank in range(2)]
    column, row = "transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.net.2"
    for rank, shard in enumerate(shards):
        assert shard[f"{column}.weight"].dtype == FP8_DTYPE and shard[f"{row}.weight"].dtype == FP8_DTYPE
        assert shard["transformer_blocks.0.norm1.linear.weight"].dtype == torch.float32  # modulations stay
        rows = full[f"{column}.weight"].chunk(2, dim=0)[rank]
        assert relative_error(shard[f"{column}.weight"].float() * shard[f"{column}.weight_scale"][:, None], rows) < 0.04
        columns = full[f"{row}.weight"].chunk(2, dim=1)[rank]
        assert relative_error(shard[f"{row}.weight"].float() * shard[f"{row}.weight_scale"][:, None], columns) < 0.04
    # Row-parallel: each rank's scales fit its own columns of the same output rows.
    assert not torch.equal(shards[0][f"{row}.weight_scale"], shards[1][f"{row}.weight_scale"])


def test_fp8_builds_are_refused_for_cpu_instances_and_for_architectures_without_fp8(tmp_path):
    with pytest.raises(Fp8Unsupported, match="--device gpu"):
        build_model_version(tmp_path, "flux", BuildRequest("flux", None, ParallelPlan(), "FP8", "cpu", progress=False))
    with pytest.raises(EngineError, match="tiny_transformer.*--dtype BF16"):
        build_model_version(tmp_path, "tiny", BuildRequest(
            "tiny_transformer", None, ParallelPlan(), "FP8", "gpu", progress=False))
    assert not list(tmp_path.glob("*/[0-9]*"))  # no version was made
    with pytest.raises(Fp8Unsupported, match="not on cpu"):
        check_fp8_device(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU can run FP8")
def test_an_fp8_engine_loaded_on_cpu_fails_naming_the_engine_and_what_to_build(tmp_path):
    version_dir = build_model_version(tmp_path, "flux", BuildRequest(
        "flux", None, ParallelPlan(), "FP8", "gpu", progress=False))
    manifest = Manifest.read(version_dir / "engine")
    assert (manifest.data_type, manifest.quantization, manifest.weight_type) == ("BF16", "fp8", "FP8")
    assert {spec.data_type for spec in manifest.inputs} == {"BF16", "FP32"}  # FP32: position ids
    with pytest.raises(EngineError, match=r"engine: FP8 engines run on NVIDIA GPUs.*--dtype BF16"):
        TorchEngine.load(version_dir / "engine", manifest, FLUX, Communicator.single())


def test_fp8_weights_take_about_two_thirds_of_bf16_and_flux_80b_fits_one_h200():
    presets = FLUX.presets()
    dev_bf16 = rank_weight_bytes(FLUX, presets["flux.1-dev"], ParallelPlan(), "BF16")
    dev_fp8 = rank_weight_bytes(FLUX, presets["flux.1-dev"], ParallelPlan(), "BF16", "fp8")
    assert 0.6 < dev_fp8 / dev_bf16 < 0.68  # the modulations (a third of the parameters) stay in bf16
    big_fp8 = rank_weight_bytes(FLUX, presets["flux-80b"], ParallelPlan(), "BF16", "fp8")
    assert big_fp8 / GIB < 139 - 4  # one H200's memory less the working memory
