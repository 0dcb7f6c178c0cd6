"""The benchmark harness (mdtriton/harness.py): the engine it loads from weights in memory is the one the server
loads from a built engine directory, the model arguments every benchmark shares, and its tables are Markdown."""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_shard
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.harness import (Size, add_model_arguments, bench_engine, flux_inputs, markdown_table, model_config,
                              model_sizes, psnr, relative_error)
from mdtriton.serving import load_engine


def test_the_harness_engine_answers_as_the_served_engine_of_the_same_weights(tmp_path):
    config = FLUX.presets()["tiny"]
    version_dir = build_model_version(tmp_path, "flux", BuildRequest(
        "flux", config, ParallelPlan(), "FP32", "cpu", seed=0, progress=False))
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


def model_arguments(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, ["wan", "flux"])
    return parser.parse_args(argv)


def test_the_model_arguments_default_to_the_architectures_published_size_and_sizes():
    args = model_arguments()
    config = model_config(args)
    assert (args.architecture, args.preset) == ("wan", "wan2.1-t2v-14b") and config["num_layers"] == 40
    assert model_sizes(args, config) == [Size(81, 480, 832), Size(81, 720, 1280)]
    assert str(Size(81, 480, 832)) == "832x480 x 81" and str(Size(1, 1024, 1024)) == "1024x1024"


def test_the_model_arguments_take_a_preset_config_changes_and_sizes():
    args = model_arguments("--architecture", "flux", "--preset", "tiny", "--config", '{"num_layers": 1}',
                           "--height", "64,32", "--width", "64,48")
    config = model_config(args)
    assert config == {**FLUX.presets()["tiny"], "num_layers": 1}
    assert model_sizes(args, config) == [Size(1, 64, 64), Size(1, 32, 48)]


@pytest.mark.parametrize("argv, message", [
    (["--preset", "flux.1-dev"], "wan has no preset 'flux.1-dev'"),
    (["--height", "480"], "give --height and --width together"),
    (["--height", "480,720", "--width", "832"], "2 heights and 1 widths"),
    (["--frames", "80"], "80 frames is not 4k+1"),
])
def test_bad_model_arguments_are_refused_saying_what_to_give(argv, message):
    args = model_arguments(*argv)
    with pytest.raises(ValueError, match=re.escape(message)):
        model_sizes(args, model_config(args))


def test_psnr_is_infinite_for_equal_images_and_falls_as_they_differ():
    image = np.full((4, 4, 3), 100, dtype=np.uint8)
    assert psnr(image, image) == float("inf")
    assert psnr(image + 1, image) == pytest.approx(20 * np.log10(255))  # an error of one level everywhere
    assert psnr(image + 10, image) < psnr(image + 1, image)
