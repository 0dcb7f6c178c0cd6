"""The benchmarks' pipeline directories (mdtriton.testing.random_pipelines), tiny: each is a diffusers directory whose
transformer/ holds the config the build reads, its class named as model_index.json names it."""

from __future__ import annotations

import json

import pytest
import torch

from mdtriton.testing.random_pipelines import flux_pipeline_dir, kontext_pipeline_dir, wan_pipeline_dir


@pytest.mark.parametrize("make", [flux_pipeline_dir, kontext_pipeline_dir, wan_pipeline_dir])
def test_each_pipeline_directory_holds_its_transformer_config(make, tmp_path):
    pipeline_dir, config = make(tmp_path / "pipeline", True, torch.device("cpu"))
    index = json.loads((pipeline_dir / "model_index.json").read_text())
    written = json.loads((pipeline_dir / "transformer" / "config.json").read_text())
    assert written["_class_name"] == index["transformer"][1]
    assert {key: written[key] for key in config} == json.loads(json.dumps(config))  # tuples as JSON lists
