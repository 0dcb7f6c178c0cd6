"""What the server asks of an engine directory: which engine serves it, and which check its requests get.

The registry of families (mdtriton.families) answers by the manifest's architecture, so the backend names no
family: a transformer engine is served as it is (TorchEngine), a pipeline by the pipeline engine with its
family's PipelinePart.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mdtriton.engine import request_check
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import Engine, TorchEngine
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.request_check import RequestError
from mdtriton.families import pipeline_part


def load_engine(engine_dir: Path, manifest: Manifest, comm: Communicator) -> Engine:
    """This rank's engine of engine_dir, whose manifest the caller has read."""
    part = pipeline_part(manifest.architecture)
    if part is None:
        return TorchEngine.load(engine_dir, manifest, comm)
    # Imported here: diffusers and transformers (the `pipeline` extra) are needed only to serve pipelines.
    from mdtriton.pipeline.engine import PipelineEngine

    return PipelineEngine.load(engine_dir, manifest, comm, part)


def check_request(manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
    """Raise RequestError, saying what to send, if the inputs are not a request this engine can run."""
    part = pipeline_part(manifest.architecture)
    if part is None:
        request_check.check_request(manifest, inputs)
        return
    optional = part.optional_inputs()
    missing = [spec.name for spec in manifest.inputs if spec.name not in inputs and spec.name not in optional]
    if missing:
        raise RequestError(f"input(s) {missing} missing; this model takes {', '.join(s.name for s in manifest.inputs)}")
    part.check_request(manifest, inputs)
