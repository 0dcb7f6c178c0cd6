"""What the server asks of an engine directory: which engine serves it, which check its requests get, the defaults of
the inputs a request leaves out, and how a text (BYTES) input becomes a tensor.

The serving layer, above the engine, LoRA, the pipelines and the families (docs/architecture.md, "Layers"): the
registry of families (mdtriton.families) answers by the manifest's architecture with the part it serves (a transformer
engine's EnginePart, a pipeline's PipelinePart), which loads the engine and checks requests, so the backend names no
family. The backend, the build tools and the benchmarks import it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.engine import Engine
from mdtriton.engine.manifest import Manifest, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.families import EnginePart, family, is_diffusers_pipeline, served_part
from mdtriton.lora.directory import AdapterSettings
from mdtriton.pipeline.prompts import text_rows
from mdtriton.pipeline.request_checks import check_text_elements

# Seconds a request may wait for all ranks (config.pbtxt's request_timeout_s; the build writes it, a pipeline's
# longer: PipelinePart.request_timeout_s) when a config does not say.
DEFAULT_REQUEST_TIMEOUT_S = EnginePart.request_timeout_s


def check_architecture(manifest: Manifest) -> None:
    """EngineError if no installed family serves the manifest's architecture. The first lookup reads the family
    registry (it imports every family's module and reads the installed packages' entry points: 73-96 ms on a GPU host),
    so a rank's stub looks up at load, and its first request does not wait for it."""
    if not is_diffusers_pipeline(manifest.architecture):
        family(manifest.architecture)


def load_engine(engine_dir: Path, manifest: Manifest, comm: Communicator,
                adapters: AdapterSettings | None = None) -> Engine:
    """This rank's engine of engine_dir, whose manifest the caller has read; a pipeline's requests may name the
    adapters kept where `adapters` says (mdtriton.lora)."""
    transformer_family = None if is_diffusers_pipeline(manifest.architecture) else family(manifest.architecture)
    return served_part(manifest.architecture, manifest.config).load_engine(engine_dir, manifest, transformer_family,
                                                                           comm, adapters)


def check_request(manifest: Manifest, inputs: dict[str, torch.Tensor], adapters_dir: Path | None = None) -> None:
    """Raise RequestError, saying what to send, if the inputs are not a request this engine can run; a pipeline's
    adapters must be kept in adapters_dir (mdtriton.lora)."""
    served_part(manifest.architecture, manifest.config).check_request(manifest, inputs, adapters_dir)


def with_defaults(manifest: Manifest, inputs: dict[str, torch.Tensor],
                  parameters: dict[str, str]) -> dict[str, torch.Tensor]:
    """inputs, in the manifest's order, with a default for each optional input the request left out: the model's, where
    config.pbtxt's parameters name the input (`mdtriton build --cache`), else the pipeline's
    (PipelinePart.optional_inputs; those without a default stay out)."""
    defaults = served_part(manifest.architecture, manifest.config).optional_inputs()
    completed = {}
    for spec in manifest.inputs:
        if spec.name in inputs:
            completed[spec.name] = inputs[spec.name]
        elif spec.name in parameters and spec.data_type == "STRING":
            completed[spec.name] = text_rows([parameters[spec.name].encode()], spec.name)
        elif defaults.get(spec.name) is not None:
            completed[spec.name] = torch.tensor([defaults[spec.name]], dtype=TORCH_DTYPES[spec.data_type])
    return completed


def text_input(manifest: Manifest, spec: TensorSpec, values) -> torch.Tensor:
    """The tensor a rank's worker gets for the BYTES elements `values` of the text input `spec` (UTF-8 rows:
    mdtriton.pipeline.prompts); RequestError, naming the input, for more elements than it takes (its shape's, or the
    batch limit where they take any number), an element over the longest taken, text that is not UTF-8 or holds a
    NUL. The counts and lengths are checked first, so that a refused request costs no tensor of rows x longest."""
    if spec.shape[0] > 0:
        most, limit = spec.shape[0], f"its shape is {list(spec.shape)}"
    else:
        most = manifest.limits.max_batch_size
        limit = "the batch limit, set at build time: mdtriton build --max-batch-size"
    check_text_elements(values, spec.name, most, limit)
    try:
        return text_rows(values, spec.name)
    except ValueError as error:
        raise RequestError(str(error)) from None
