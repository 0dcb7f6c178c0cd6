"""The benchmark harness (mdtriton/harness.py): the engine it loads from weights in memory is the one the server
loads from a built engine directory, and its tables are Markdown."""

from __future__ import annotations

import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.engine_builder import random_shard
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.harness import bench_engine, flux_inputs, markdown_table, relative_error
from mdtriton.serving import load_engine


def test_the_harness_engine_answers_as_the_served_engine_of_the_same_weights(tmp_path):
    config = FLUX.presets()["tiny"]
    version_dir = build_model_version(tmp_path, "flux", "flux", config, ParallelPlan(), "FP32", "cpu", seed=0,
                                      progress=False)
    engine_dir = version_dir / "engine"
    served = load_engine(engine_dir, Manifest.read(engine_dir), Communicator.single())
    ours = bench_engine("flux", config, Communicator.single(),
                        random_shard("flux", config, ParallelPlan(), 0, seed=0), "FP32")
    assert ours.manifest.inputs == served.manifest.inputs and ours.manifest.outputs == served.manifest.outputs
    inputs = flux_inputs(config, 8, 16, torch.device("cpu"))
    # The same weights, but the served engine's are mapped from its file: CPU kernels round differently on
    # differently aligned memory (~1e-6 in float32, docs/architecture.md), so equal to rounding, not bit for bit.
    assert relative_error(ours.forward(inputs)["sample"], served.forward(inputs)["sample"]) < 1e-5


def test_a_table_is_a_markdown_header_separator_and_rows():
    table = markdown_table(["tokens", "median ms"], [["4,096+512", "79.3"], [16, 1.5]])
    assert table.splitlines() == ["| tokens | median ms |", "|---|---|", "| 4,096+512 | 79.3 |", "| 16 | 1.5 |"]
