"""The checks a request passes before any rank sees it: limits from the manifest and the architecture's own
consistency checks (check_engine_request, in the stub: shapes only), and finite values (check_finite, in the worker)."""

from __future__ import annotations

import pytest
import torch

from mdtriton.engine.manifest import EngineLimits, Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.request_check import RequestError, check_engine_request, check_finite
from mdtriton.families import family
from mdtriton.families.flux.transformer import TINY_CONFIG
from tests.engine.flux_cases import flux_inputs


def manifest(architecture: str, config: dict, limits: EngineLimits, data_type: str = "FP32") -> Manifest:
    inputs, outputs = family(architecture).signature(config, data_type)
    return Manifest(architecture, config, ParallelPlan(), data_type, inputs, outputs, limits=limits)


TINY = manifest("tiny_transformer", {"hidden_size": 8, "num_heads": 2, "mlp_ratio": 2, "num_layers": 1},
                EngineLimits(max_batch_size=2, max_tokens=16), data_type="FP16")
FLUX = manifest("flux", TINY_CONFIG, EngineLimits(max_batch_size=2, max_tokens=20))


def test_limits_are_inclusive():
    tiny = family(TINY.architecture)
    check_engine_request(TINY, tiny, {"hidden_states": torch.zeros(2, 16, 8, dtype=torch.float16)})
    with pytest.raises(RequestError, match="batch size 3 is over this engine's maximum of 2"):
        check_engine_request(TINY, tiny, {"hidden_states": torch.zeros(3, 16, 8, dtype=torch.float16)})
    with pytest.raises(RequestError, match="17 tokens, over this engine's maximum of 16"):
        check_engine_request(TINY, tiny, {"hidden_states": torch.zeros(1, 17, 8, dtype=torch.float16)})


def test_only_real_nan_or_infinity_is_refused_not_an_overflowing_sum():
    large = torch.full((2, 16, 8), 60000.0, dtype=torch.float16)  # finite, but its float16 sum overflows
    assert not torch.isfinite(large.sum())
    check_finite({"hidden_states": large})
    huge = torch.full((4,), 1e300, dtype=torch.float64)  # finite, but its float32 sum is not
    check_finite({"hidden_states": huge})
    large[1, 2, 3] = float("inf")
    large[0, 0, 0] = float("nan")
    with pytest.raises(RequestError, match="'hidden_states' holds 2 NaN or infinite"):
        check_finite({"hidden_states": large})


def test_check_finite_names_the_first_bad_input_and_skips_integers():
    good = flux_inputs(TINY_CONFIG, text_len=6, image_len=14, batch=2)
    check_finite({**good, "seed": torch.tensor([7])})
    bad = {**good, "timestep": torch.tensor([0.5, float("nan")]), "guidance": torch.tensor([float("inf")] * 2)}
    with pytest.raises(RequestError, match="^input 'timestep' holds 1 NaN or infinite value\\(s\\); send finite numbers$"):
        check_finite(bad)


def test_check_engine_request_reads_shapes_not_values():
    """The stub's check leaves the values to the worker, whose device reads them in microseconds."""
    nan = torch.full((2, 16, 8), float("nan"), dtype=torch.float16)
    check_engine_request(TINY, family(TINY.architecture), {"hidden_states": nan})


def test_flux_inputs_must_agree_and_count_text_plus_image_tokens():
    good = flux_inputs(TINY_CONFIG, text_len=6, image_len=14, batch=2)
    flux = family(FLUX.architecture)
    check_engine_request(FLUX, flux, good)
    with pytest.raises(RequestError, match="21 tokens"):
        check_engine_request(FLUX, flux, flux_inputs(TINY_CONFIG, text_len=7, image_len=14, batch=2))
    with pytest.raises(RequestError, match="img_ids has 13 rows but hidden_states has 14 image tokens"):
        check_engine_request(FLUX, flux, {**good, "img_ids": good["img_ids"][:13]})
    with pytest.raises(RequestError, match="guidance has batch size 1 but hidden_states has 2"):
        check_engine_request(FLUX, flux, {**good, "guidance": good["guidance"][:1]})
    with pytest.raises(RequestError, match="input 'txt_ids' is missing"):
        check_engine_request(FLUX, flux, {name: t for name, t in good.items() if name != "txt_ids"})
