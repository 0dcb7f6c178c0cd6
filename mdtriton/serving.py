"""What the server asks of an engine directory: which engine serves it, which check its requests get, the defaults of
the inputs a request leaves out, and how a text (BYTES) input becomes a tensor.

The serving layer, above the engine, LoRA, the pipelines and the families (docs/architecture.md, "Layers"): the
registry of families (mdtriton.families) answers by the manifest's architecture and the family is handed to the
engine, so the backend names no family: a transformer engine is served as it is (TorchEngine), a pipeline by the
pipeline engine with its family's PipelinePart. The backend, the build tools and the benchmarks import it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mdtriton.engine import request_check
from mdtriton.engine.comm import Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.engine import Engine, TorchEngine
from mdtriton.engine.manifest import Manifest, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.families import family, is_diffusers_pipeline, pipeline_part
from mdtriton.lora.adapter_file import AdapterError, check_adapter
from mdtriton.lora.directory import AdapterSettings, adapter_names, adapter_path
from mdtriton.pipeline.prompts import text_rows
from mdtriton.pipeline.request_checks import check_text_elements, loras_of, step_cache_of

# Seconds a request may wait for all ranks (config.pbtxt's request_timeout_s; the build writes it, a pipeline's
# longer: PipelinePart.request_timeout_s) when a config does not say.
DEFAULT_REQUEST_TIMEOUT_S = 30.0


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
    part = pipeline_part(manifest.architecture, manifest.config)
    if part is None:
        return TorchEngine.load(engine_dir, manifest, family(manifest.architecture), comm)
    # Imported here: diffusers and transformers (the `pipeline` extra) are needed only to serve pipelines.
    from mdtriton.pipeline.engine import PipelineEngine

    transformer_family = None if is_diffusers_pipeline(manifest.architecture) else family(manifest.architecture)
    return PipelineEngine.load(engine_dir, manifest, transformer_family, comm, part, adapters)


def check_request(manifest: Manifest, inputs: dict[str, torch.Tensor], adapters_dir: Path | None = None) -> None:
    """Raise RequestError, saying what to send, if the inputs are not a request this engine can run; a pipeline's
    adapters must be kept in adapters_dir (mdtriton.lora)."""
    part = pipeline_part(manifest.architecture, manifest.config)
    if part is None:
        request_check.check_request(manifest, family(manifest.architecture), inputs)
        return
    optional = part.served_optional_inputs()
    missing = [spec.name for spec in manifest.inputs if spec.name not in inputs and spec.name not in optional]
    if missing:
        raise RequestError(f"input(s) {missing} missing; this model takes {', '.join(s.name for s in manifest.inputs)}")
    part.check_request(manifest, inputs)
    cache = step_cache_of(inputs)
    if cache is not None and cache.method not in part.cache_methods:
        raise RequestError(f"cache method {cache.method!r} is not offered by {manifest.architecture}; its methods: "
                           f"{', '.join(part.cache_methods + ('none',))}")
    loras = loras_of(inputs)
    if loras:
        kept = adapter_names(adapters_dir) if adapters_dir is not None else []
        unknown = [name for name in loras if name not in kept]
        if unknown:
            raise RequestError(f"this model has no adapter {unknown[0]!r}; its adapters: {', '.join(kept) or 'none'} "
                               "(mdtriton lora add puts one there)")
        for name in loras:
            try:
                check_adapter(adapter_path(adapters_dir, name))
            except AdapterError as error:
                raise RequestError(f"adapter {name!r} cannot be used: {error}") from None


def with_defaults(manifest: Manifest, inputs: dict[str, torch.Tensor],
                  parameters: dict[str, str]) -> dict[str, torch.Tensor]:
    """inputs, in the manifest's order, with a default for each optional input the request left out: the model's, where
    config.pbtxt's parameters name the input (`mdtriton build --cache`), else the pipeline's
    (PipelinePart.optional_inputs; those without a default stay out)."""
    part = pipeline_part(manifest.architecture, manifest.config)
    defaults = part.optional_inputs() if part is not None else {}
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
