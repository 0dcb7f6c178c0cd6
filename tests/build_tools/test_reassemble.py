"""The second path: an engine's rank files re-assembled into the whole model, streamed block by block."""

from __future__ import annotations

import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.build_tools.reassemble import EngineWeights, StreamedUnit, streamed_reference
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from tests.engine.flux_cases import flux_inputs, max_relative_error


@pytest.mark.parametrize("plan", [ParallelPlan(tp_size=4), ParallelPlan(tp_size=2, cp_size=2, cp_method="ulysses")])
def test_rank_files_reassemble_into_the_full_weights(tmp_path, plan):
    config = FLUX.default_config()
    version_dir = build_model_version(tmp_path, "flux", BuildRequest(
        "flux", config, plan, "FP32", "cpu", seed=6, progress=False))
    weights = EngineWeights(version_dir / "engine")
    expected = random_weights("flux", config, 6)
    for name, tensor in expected.items():
        assert torch.equal(weights.read(name), tensor), name


def test_streamed_reference_matches_the_whole_model_and_holds_one_block_at_a_time(tmp_path):
    config = FLUX.default_config()
    version_dir = build_model_version(tmp_path, "flux", BuildRequest(
        "flux", config, ParallelPlan(tp_size=2), "FP32", "cpu", seed=7, progress=False))
    streamed = streamed_reference(version_dir / "engine", "cpu", torch.float32)
    whole = reference_module("flux", config, random_weights("flux", config, 7), "FP32")
    inputs = flux_inputs(config, text_len=5, image_len=12)
    with torch.inference_mode():
        assert max_relative_error(streamed(**inputs)["sample"], whole(**inputs)["sample"]) < 1e-6
    units = [module for module in streamed.modules() if isinstance(module, StreamedUnit)]
    assert len(units) == 2 + 2 + 5  # double and single blocks, the embedders and the output layers
    # What stays between calls holds no weights: each unit's copy with weights was dropped after it ran.
    assert all(p.is_meta for unit in units for p in unit.template[0].parameters())
