"""The fit check: an engine too big for its GPUs is refused before anything is allocated, with what would fit."""

from __future__ import annotations

import pytest

from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.memory import GIB, WORKING_MEMORY_BYTES, check_fits, rank_weight_bytes
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG


def dev_manifest(plan: ParallelPlan) -> Manifest:
    inputs, outputs = FLUX.signature(FLUX_DEV_CONFIG, "BF16")
    return Manifest("flux", FLUX_DEV_CONFIG, plan, "BF16", inputs, outputs)


def test_weight_bytes_split_with_tensor_parallelism_only():
    one = rank_weight_bytes(FLUX, FLUX_DEV_CONFIG, ParallelPlan(), "BF16")
    assert one == pytest.approx(2 * 11.9e9, rel=0.01)  # FLUX.1-dev: 11.9 B parameters
    assert rank_weight_bytes(FLUX, FLUX_DEV_CONFIG, ParallelPlan(cp_size=4), "BF16") == one
    tp2 = rank_weight_bytes(FLUX, FLUX_DEV_CONFIG, ParallelPlan(tp_size=2), "BF16")
    tp4 = rank_weight_bytes(FLUX, FLUX_DEV_CONFIG, ParallelPlan(tp_size=4), "BF16")
    replicated = 2 * tp2 - one  # per rank: replicated + split / tp
    assert one / 2 < tp2 < one and tp4 == pytest.approx(replicated + (one - replicated) / 4)


def test_engine_that_fits_passes():
    check_fits(dev_manifest(ParallelPlan()), FLUX, 0, 80 * GIB, "free")


def test_engine_too_big_names_the_memory_and_the_tp_size_that_fits():
    memory = 16 * GIB
    with pytest.raises(EngineError) as caught:
        check_fits(dev_manifest(ParallelPlan()), FLUX, 3, memory, "free")
    message = str(caught.value)
    assert "needs 22.2 GiB of weights per GPU" in message and "GPU 3 has 16.0 GiB free" in message
    tp = int(message.split("--tp ")[1].split()[0])
    fits = rank_weight_bytes(FLUX, FLUX_DEV_CONFIG, ParallelPlan(tp_size=tp), "BF16") + WORKING_MEMORY_BYTES
    smaller = rank_weight_bytes(FLUX, FLUX_DEV_CONFIG, ParallelPlan(tp_size=tp // 2), "BF16") + WORKING_MEMORY_BYTES
    assert fits <= memory < smaller and tp in (2, 3, 4)


def test_nothing_fits_says_so():
    with pytest.raises(EngineError, match="no tensor-parallel size up to 64 fits"):
        check_fits(dev_manifest(ParallelPlan()), FLUX, 0, 3 * GIB, "free")


def test_80b_preset_needs_more_than_one_h200():
    from mdtriton.families.flux.transformer import FLUX_80B_CONFIG

    h200 = 143771 * (1 << 20)
    inputs, outputs = FLUX.signature(FLUX_80B_CONFIG, "BF16")
    manifest = Manifest("flux", FLUX_80B_CONFIG, ParallelPlan(), "BF16", inputs, outputs)
    assert rank_weight_bytes(FLUX, FLUX_80B_CONFIG, ParallelPlan(), "BF16") > 150e9
    with pytest.raises(EngineError, match="build it with --tp 2"):
        check_fits(manifest, FLUX, 0, h200, "in all")
