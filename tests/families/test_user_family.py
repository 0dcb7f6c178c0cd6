"""A family from outside the package: a user's own module, registered through the `mdtriton.families` entry point
group, built by `mdtriton build`, served on 2 CPU ranks and checked against one process, without touching any
file of mdtriton.

The toy family is written to a temporary directory with the dist-info that declares its entry point (what
`pip install` of the user's package would leave in site-packages) and reaches every process through PYTHONPATH:
the build, the server's stubs and the rank workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.client.grpc_client import Client, ClientError
from mdtriton.families import architecture_names, families
from tests.conftest import start_server

TOY_MODULE = '''
"""A toy family: a two-layer MLP per token, split by tensor parallelism."""

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.layers import ColumnParallelLinear, RowParallelLinear, fuse_columns
from mdtriton.engine.manifest import TensorSpec
from mdtriton.families import Family, RequestSize


class ToyMLP(nn.Module):
    def __init__(self, config, comm):
        super().__init__()
        self.fc1 = ColumnParallelLinear(config["dim"], config["hidden"], comm)
        self.fc2 = RowParallelLinear(config["hidden"], config["dim"], comm)

    def fuse_projections(self):
        pass

    def compiled_regions(self):
        return [self]

    def forward(self, x):
        return {"y": self.fc2(F.gelu(self.fc1(x))) + x}


class ToyFamily(Family):
    name = "toy"
    description = "a toy MLP (a test's own family)"
    module_class = ToyMLP

    def presets(self):
        return {"small": {"dim": 12, "hidden": 32}}

    def check_plan(self, config, plan):
        if plan.cp_size > 1 or config["hidden"] % plan.tp_size:
            raise ValueError(f"toy splits its hidden size {config['hidden']} by tensor parallelism only")

    def signature(self, config, data_type):
        return ((TensorSpec("x", data_type, (-1, -1, config["dim"])),),
                (TensorSpec("y", data_type, (-1, -1, config["dim"])),))

    def request_size(self, config, inputs):
        batch, tokens = inputs["x"].shape[:2]
        if tokens > 16:
            raise ValueError(f"x has {tokens} tokens; toy takes at most 16")
        return RequestSize(batch, tokens)

    def warm_up_requests(self, config, dtype):
        return [self.example_request(config, 6, dtype, batch=3), self.example_request(config, 10, dtype)]

    def example_request(self, config, tokens, dtype, batch=1):
        return {"x": torch.randn(batch, tokens, config["dim"], generator=torch.Generator().manual_seed(0)).to(dtype)}


TOY = ToyFamily()
'''
CONFIG = {"dim": 12, "hidden": 32}
SEED = 5


@pytest.fixture(scope="module")
def toy_package(tmp_path_factory):
    """A directory holding the toy family and its dist-info, as an installed package would leave them."""
    root = tmp_path_factory.mktemp("user_package")
    (root / "toy_family.py").write_text(textwrap.dedent(TOY_MODULE))
    info = root / "mdtriton_toy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mdtriton-toy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mdtriton.families]\ntoy = toy_family:TOY\n")
    return root


@pytest.fixture(scope="module")
def with_toy_family(toy_package):
    """This process, the build and the server see the toy package (PYTHONPATH, sys.path, a fresh registry)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join([str(toy_package)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        patch.syspath_prepend(str(toy_package))
        families.cache_clear()
        yield
    families.cache_clear()


@pytest.fixture(scope="module")
def served(with_toy_family, tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    build = subprocess.run([sys.executable, "-m", "mdtriton.cli", "build", str(repository), "--name", "toy",
                            "--architecture", "toy", "--tp", "2", "--seed", str(SEED), "--config", '{"hidden": 32}'],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    server = start_server(repository, repository.parent / "server.log")
    yield server
    server.stop()


def test_the_registry_lists_an_installed_family_and_the_build_offers_it(with_toy_family):
    assert "toy" in architecture_names() and "toy" in families()
    help_text = subprocess.run([sys.executable, "-m", "mdtriton.cli", "build", "--help"], capture_output=True,
                               text=True, timeout=120).stdout
    assert "toy: a toy MLP (a test's own family)" in " ".join(help_text.split())


@pytest.mark.timeout(300)
def test_a_user_family_builds_serves_and_answers_as_one_process(served):
    x = torch.randn(2, 8, CONFIG["dim"], generator=torch.Generator().manual_seed(1))
    module = reference_module("toy", CONFIG, random_weights("toy", CONFIG, SEED), "FP32")
    with torch.inference_mode():
        expected = module(x)["y"].numpy()
    with Client(served.grpc_address) as client:
        y = client.infer("toy", {"x": x})["y"]
        assert np.abs(y - expected).max() < 1e-5
        with pytest.raises(ClientError, match="x has 17 tokens; toy takes at most 16"):
            client.infer("toy", {"x": torch.zeros(1, 17, CONFIG["dim"])})
        assert np.abs(client.infer("toy", {"x": x})["y"] - expected).max() < 1e-5  # still serving
