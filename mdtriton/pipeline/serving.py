"""Which engine serves an engine directory, and which check its requests get, by the manifest's architecture.

A pipeline engine directory holds a transformer engine and the pipeline's other components; every other
architecture is a transformer engine served as it is (TorchEngine).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mdtriton.engine import request_check
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import Engine, TorchEngine
from mdtriton.engine.manifest import Manifest
from mdtriton.pipeline.request_check import check_pipeline_request
from mdtriton.pipeline.signature import ARCHITECTURE


def load_engine(engine_dir: Path, manifest: Manifest, comm: Communicator) -> Engine:
    """This rank's engine of engine_dir, whose manifest the caller has read, by its class for the architecture."""
    if manifest.architecture == ARCHITECTURE:
        # Imported here: diffusers and transformers (the `pipeline` extra) are needed only to serve pipelines.
        from mdtriton.pipeline.flux_pipeline import FluxPipelineEngine

        return FluxPipelineEngine.load(engine_dir, manifest, comm)
    return TorchEngine.load(engine_dir, manifest, comm)


def check_request(manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
    """Raise RequestError, saying what to send, if the inputs are not a request this engine can run."""
    if manifest.architecture == ARCHITECTURE:
        check_pipeline_request(manifest, inputs)
    else:
        request_check.check_request(manifest, inputs)
