"""An elastic model on 2 GPUs, NCCL ranks (tiny FLUX pipeline, ulysses 2, float32, streaming its steps): a request
alone runs on both GPUs; requests that queue run at once on one GPU each (their spans overlap); every image equals
the same request's on the model that is not elastic (tests/backend/test_elastic.py's checks, on GPUs)."""

from __future__ import annotations

import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.model_config import read_model_config, write_model_config
from mdtriton.engine.plan import ParallelPlan
from tests.backend.test_elastic import (LIMITS, test_a_request_alone_takes_both_ranks_and_equals_the_whole_world,
                                        test_queued_requests_run_at_once_on_one_rank_each_and_equal_the_whole_world)
from tests.conftest import start_server
from tests.pipeline.pipelines import save_pipelines

pytestmark = pytest.mark.gpu
__all__ = ["test_a_request_alone_takes_both_ranks_and_equals_the_whole_world",
           "test_queued_requests_run_at_once_on_one_rank_each_and_equal_the_whole_world"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server on GPUs 0 and 1: "elastic" (--elastic, elastic_min_speedup 0) and "whole", the same tiny FLUX.1-dev
    pipeline."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = tmp_path_factory.mktemp("elastic-gpu")
    pipeline_dir = save_pipelines(root)["dev"]
    for name, elastic in (("elastic", True), ("whole", False)):
        build_model_version(root / "repository", name, BuildRequest(
            "flux-pipeline", None, ParallelPlan(cp_size=2, cp_method="ulysses", elastic=elastic), "FP32", "gpu",
            gpus=[0, 1], weights_path=pipeline_dir, progress=False, limits=LIMITS, stream=True))
    # A lone request on both GPUs whatever the ranks' table says of so small a model.
    config = read_model_config(root / "repository" / "elastic" / "config.pbtxt")
    config.parameters["elastic_min_speedup"].string_value = "0"
    write_model_config(root / "repository" / "elastic" / "config.pbtxt", config)
    server = start_server(root / "repository", root / "server.log")
    yield server
    server.stop()
