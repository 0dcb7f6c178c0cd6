"""What the build and the server ask of the model an architecture name serves (`ServedPart`), for its two kinds: a
transformer engine served as it is (`EnginePart`) and a family's diffusers pipeline around transformer engines (the
`PipelinePart` a family declares: mdtriton.families), with the inputs and outputs every served pipeline has beside its
own. mdtriton.families.served_part looks the part up by architecture name; its callers ask it, never which kind it is,
what differs (docs/architecture.md, "Model families")."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from mdtriton.engine.architecture import Architecture
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import Engine, TorchEngine
from mdtriton.engine.manifest import EngineLimits, Manifest, Signature, TensorSpec
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.request_check import RequestError, check_engine_request
from mdtriton.lora.adapter_file import AdapterError, check_adapter
from mdtriton.lora.directory import AdapterSettings, adapter_names, adapter_path
from mdtriton.pipeline.encoder import ENCODING_RANK
from mdtriton.pipeline.request_checks import loras_of, step_cache_of


# What every pipeline takes and answers beside its own inputs and outputs: the step cache (a JSON object as text:
# mdtriton.engine.step_cache; left out, the model's default from config.pbtxt's parameters, else none), the LoRA
# adapters merged into the transformer for this request (a JSON object of names and scales: mdtriton.lora; left out,
# none), and how many denoising steps ran every transformer block.
SHARED_INPUTS = (TensorSpec("cache", "STRING", (1,)), TensorSpec("loras", "STRING", (1,)))
SHARED_OUTPUTS = (TensorSpec("full_steps", "INT32", (1,)),)


class ServedPart(ABC):
    """What the build and the server ask of a served model, whichever kind it is: an `EnginePart` or a
    `PipelinePart`."""

    # The folders of the engine directory that hold transformer engines (their weight files are the model's):
    # a transformer engine's is the directory itself, "".
    transformers: ClassVar[tuple[str, ...]]
    # Whether the model runs a conditional and an unconditional transformer call per step (classifier-free
    # guidance), which guidance parallelism (a plan's cfg_size 2) runs on two rank groups at once.
    guidance_branches: ClassVar[bool] = False
    request_timeout_s: ClassVar[float]  # the default of the longest a request may wait for all ranks
    # Whether Triton sends each instance a small all-zeros request as it loads the model (the ranks meet at it).
    warmed_up_at_load: ClassVar[bool]

    @abstractmethod
    def optional_inputs(self) -> dict[str, int | float | None]:
        """Inputs a request may leave out, with the value a request without it gets (None: no value, leaving it out
        means something of its own)."""

    def model_parameters(self) -> dict[str, str]:
        """Parameters the model's config.pbtxt holds beside those every model's does; by default none."""
        return {}

    @abstractmethod
    def served_manifest(self, architecture: str, transformer: Manifest, pipeline_dir: Path | None,
                        limits: EngineLimits) -> Manifest:
        """The manifest of the served model of architecture, whose transformer engines' is `transformer`
        (pipeline_dir: the diffusers directory a pipeline is built from)."""

    @abstractmethod
    def load_engine(self, engine_dir: Path, manifest: Manifest, architecture: Architecture | None,
                    comm: Communicator, adapters: AdapterSettings | None = None) -> Engine:
        """This rank's engine of engine_dir, whose manifest the caller has read; architecture: the family of its
        transformer engines (None: diffusers' own transformer); requests may name the adapters kept where `adapters`
        says (mdtriton.lora)."""

    @abstractmethod
    def check_request(self, manifest: Manifest, inputs: dict[str, torch.Tensor],
                      adapters_dir: Path | None = None) -> None:
        """Raise RequestError, saying what to send instead, if the inputs are not a request this served model can
        run; the adapters a request names must be kept in adapters_dir (mdtriton.lora)."""


class EnginePart(ServedPart):
    """A family's transformer engine, served as it is: the request is the transformer's inputs, every one given."""

    transformers = ("",)
    request_timeout_s = 30.0
    warmed_up_at_load = True

    def __init__(self, architecture: Architecture):
        self.architecture = architecture

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {}

    def served_manifest(self, architecture: str, transformer: Manifest, pipeline_dir: Path | None,
                        limits: EngineLimits) -> Manifest:
        return transformer

    def load_engine(self, engine_dir: Path, manifest: Manifest, architecture: Architecture | None,
                    comm: Communicator, adapters: AdapterSettings | None = None) -> Engine:
        """The rank's TorchEngine of this part's family (`architecture` is the same); a transformer engine takes no
        adapters."""
        return TorchEngine.load(engine_dir, manifest, self.architecture, comm)

    def check_request(self, manifest: Manifest, inputs: dict[str, torch.Tensor],
                      adapters_dir: Path | None = None) -> None:
        """The engine's checks of its shapes and limits (mdtriton.engine.request_check)."""
        check_engine_request(manifest, self.architecture, inputs)


class PipelinePart(ServedPart):
    """A family's whole diffusers pipeline, served as one model: the denoising loop on the server, the transformer
    our multi-rank engine, every other component loaded by diffusers from the pipeline's directory.

    The served model's inputs become the pipeline's call (`call_arguments`), its result the outputs (`outputs`).
    """

    diffusers_class: ClassVar[str]  # model_index.json's _class_name, e.g. "FluxPipeline"
    # The pipeline's transformer components, which become engines (in the engine directory's folders of these names)
    # where its model_index.json lists them: Wan 2.2 A14B has two experts.
    transformers: ClassVar[tuple[str, ...]] = ("transformer",)
    # Components loaded in float32 whatever the engine's data type (Wan's VAE, as diffusers' Wan examples load it);
    # the others in the engine's data type.
    float32_components: ClassVar[tuple[str, ...]] = ()
    request_timeout_s: ClassVar[float] = 300.0  # a request is a whole image or video: every step
    warmed_up_at_load = False  # a warm-up would run a whole image: the ranks meet at the first request
    # The step cache methods its transformer runs (mdtriton.engine.step_cache): First Block Cache needs the module's
    # first_block, other_blocks and finish; TaylorSeer its keep_attention and given_attention.
    cache_methods: ClassVar[tuple[str, ...]] = ("first_block",)
    # Why a method is not offered, said where a request asks for it ("" where nothing needs saying).
    cache_note: ClassVar[str] = ""
    # Components that run once per request, before the denoising (a text encoder), which a plan of more ranks loads on
    # the encoding rank only, broadcasting what the pipeline's encode_prompt returns (mdtriton.pipeline.encoder; not on
    # an elastic plan); none: every rank holds every component.
    one_rank_components: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def signature(self) -> Signature:
        """The pipeline's own inputs and outputs (served with SHARED_INPUTS and SHARED_OUTPUTS after them:
        served_signature); progress responses carry the `step` output only."""

    @abstractmethod
    def optional_inputs(self) -> dict[str, int | float | None]:
        """Inputs of `signature` a request may leave out (every one but the prompt), with the value a request without
        it gets (the diffusers pipeline's default; the seed's is 0), or None where leaving it out means something of
        its own (no second prompt, the longest text). docs/client.md lists them."""

    def served_signature(self) -> Signature:
        """The served model's inputs and outputs: the pipeline's own, then those every pipeline has."""
        inputs, outputs = self.signature()
        return inputs + SHARED_INPUTS, outputs + SHARED_OUTPUTS

    def served_optional_inputs(self) -> dict[str, int | float | None]:
        """optional_inputs, and the shared inputs (all optional, none with a default of its own)."""
        return {**self.optional_inputs(), **{spec.name: None for spec in SHARED_INPUTS}}

    def model_parameters(self) -> dict[str, str]:
        """request_defaults: what `mdtriton generate` sends for what its command line leaves out (optional_inputs),
        without the family."""
        return {"request_defaults": json.dumps(self.optional_inputs())}

    def served_manifest(self, architecture: str, transformer: Manifest, pipeline_dir: Path | None,
                        limits: EngineLimits) -> Manifest:
        """The pipeline's: its served signature, its transformer's config and what its request checks need to know
        of its directory (pipeline_config)."""
        inputs, outputs = self.served_signature()
        return Manifest(architecture, {"transformer": transformer.config, **self.pipeline_config(pipeline_dir)},
                        transformer.plan, transformer.data_type, inputs, outputs, limits=limits)

    def load_engine(self, engine_dir: Path, manifest: Manifest, architecture: Architecture | None,
                    comm: Communicator, adapters: AdapterSettings | None = None) -> Engine:
        """The rank's PipelineEngine."""
        # Imported here: diffusers and transformers (the `pipeline` extra) are needed only to serve pipelines.
        from mdtriton.pipeline.engine import PipelineEngine

        return PipelineEngine.load(engine_dir, manifest, architecture, comm, self, adapters)

    def load_arguments(self, pipeline_dir: Path) -> dict:
        """Arguments of the pipeline's `from_pretrained` beside the components (e.g. a component left out where the
        environment lacks its package, or one built from pipeline_dir otherwise); read when a rank loads the
        pipeline."""
        return {}

    def encodes_on_one_rank(self, plan: ParallelPlan) -> bool:
        """Whether plan's ranks encode the prompts on one rank (one_rank_components): more than one rank, not elastic
        (an elastic model's job may run on a group without the encoding rank)."""
        return bool(self.one_rank_components) and plan.world_size > 1 and not plan.elastic

    def components_not_on(self, plan: ParallelPlan, rank: int) -> tuple[str, ...]:
        """The components rank of plan does not load: one_rank_components, on every rank but the encoding one."""
        return self.one_rank_components if self.encodes_on_one_rank(plan) and rank != ENCODING_RANK else ()

    def prepare(self, pipeline: Any, comm: Communicator, compiled: bool) -> None:
        """Make the loaded pipeline ready on this rank, before its transformers are set (a pipeline that splits
        diffusers' own transformer splits it here, and compiles it if compiled: GPU ranks); by default nothing."""

    def before_call(self, pipeline: Any, arguments: dict) -> None:
        """Ready the pipeline for one request's call with arguments (call_arguments'); by default nothing."""

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """What the request checks need to know of the directory beside the transformer's config (e.g. the VAE's
        scale factor); kept in the pipeline's manifest."""
        return {}

    def check_request(self, manifest: Manifest, inputs: dict[str, torch.Tensor],
                      adapters_dir: Path | None = None) -> None:
        """Raise RequestError, saying what to send instead, for an input left out that is not optional, inputs the
        pipeline cannot run (check_inputs), a step cache method its transformer does not offer, or an adapter not
        kept in adapters_dir or that cannot be used (mdtriton.lora)."""
        optional = self.served_optional_inputs()
        missing = [spec.name for spec in manifest.inputs if spec.name not in inputs and spec.name not in optional]
        if missing:
            raise RequestError(f"input(s) {missing} missing; this model takes "
                               f"{', '.join(s.name for s in manifest.inputs)}")
        self.check_inputs(manifest, inputs)
        cache = step_cache_of(inputs)
        if cache is not None and cache.method not in self.cache_methods:
            raise RequestError(f"cache method {cache.method!r} is not offered by {manifest.architecture}; its methods: "
                               f"{', '.join(self.cache_methods + ('none',))}" + (f" ({self.cache_note})"
                                                                                 if self.cache_note else ""))
        loras = loras_of(inputs)
        if loras:
            kept = adapter_names(adapters_dir) if adapters_dir is not None else []
            unknown = [name for name in loras if name not in kept]
            if unknown:
                raise RequestError(f"this model has no adapter {unknown[0]!r}; its adapters: "
                                   f"{', '.join(kept) or 'none'} (mdtriton lora add puts one there)")
            for name in loras:
                try:
                    check_adapter(adapter_path(adapters_dir, name))
                except AdapterError as error:
                    raise RequestError(f"adapter {name!r} cannot be used: {error}") from None

    @abstractmethod
    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Raise RequestError, saying what to send instead, if the inputs (the optional ones perhaps left out) are not
        ones the pipeline can run: its own limits and how its inputs fit together."""

    def request_tokens(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> int | None:
        """The tokens the transformer runs over for a checked request (an elastic model sizes a lone request's group of
        ranks by them: backend/job_scheduler.py); None, the default, where the part does not count them (such a
        request takes the largest free group)."""
        return None

    @abstractmethod
    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        """The diffusers pipeline's call arguments for a request (not its callbacks nor output_type)."""

    @abstractmethod
    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """The served outputs of the pipeline's result (called with output_type "pt"), on the pipeline's device: an
        engine answers on its communicator's device (mdtriton.engine.comm, the device contract)."""

    def outputs_of(self, manifest: Manifest, result: Any) -> dict[str, torch.Tensor]:
        """The served outputs of a request's result: `outputs`, and what a part adds from the model's manifest (LTX-2:
        its sound's sample rate)."""
        return self.outputs(result)

    @abstractmethod
    def transformer(self, engine: TorchEngine, pipeline: Any) -> nn.Module:
        """A transformer engine, called as the pipeline (the diffusers pipeline it serves in) calls its diffusers
        transformer."""


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """A pipeline's images [B, 3, H, W] in [0, 1] (output_type "pt") as the served UINT8 [B, H, W, 3], rounded as
    diffusers' numpy_to_pil (in float32), on the images' device."""
    return (images.float().permute(0, 2, 3, 1) * 255).round().to(torch.uint8)
