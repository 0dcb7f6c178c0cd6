"""What a model family declares, once, for the build, the load and the server to use.

A family is a diffusers transformer (FLUX, the tiny test transformer, a user's own) split rank by rank:
`Family` says how its module is built and configured, which plans can split it, what a request to its
transformer engine looks like and how big it is, and what warms it up. A family that serves a whole diffusers
pipeline (prompt in, image or video out) adds a `PipelinePart`. Families are registered by name
(mdtriton.families); an engine's manifest names its architecture: the family's name for its transformer engine,
`<name>-pipeline` for its pipeline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from mdtriton.engine.architecture import Architecture, RequestSize
from mdtriton.engine.manifest import DEFAULT_MAX_TOKENS, TensorSpec
from mdtriton.engine.plan import ParallelPlan

if TYPE_CHECKING:
    from mdtriton.engine.engine import TorchEngine
    from mdtriton.engine.manifest import Manifest

__all__ = ["Family", "PipelinePart", "RequestSize", "Signature"]  # what a family's module needs

Signature = tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]  # (inputs, outputs)


class Family(Architecture):
    """A transformer family: its module, config, plans, requests and warm-up (what the engine uses of it:
    mdtriton.engine.architecture), its presets and signature, and its pipeline if it serves one. Subclass it and
    register an instance (mdtriton.families: built in, or a user's package through the `mdtriton.families` entry point
    group)."""

    description: ClassVar[str]  # one line for `mdtriton build --help`
    pipeline: ClassVar[PipelinePart | None] = None  # the served diffusers pipeline, if the family has one
    max_tokens: ClassVar[int] = DEFAULT_MAX_TOKENS  # the default limit of a request's tokens (mdtriton build --max-tokens)

    @abstractmethod
    def presets(self) -> dict[str, dict]:
        """Named configs, the first being the default (tests' size)."""

    def default_config(self) -> dict:
        return next(iter(self.presets().values()))

    def config_from_diffusers(self, config_json: dict) -> dict:
        """The config of a diffusers checkpoint's `config.json`: its keys that this family's configs have, over the
        default config's."""
        known = self.default_config()
        return {**known, **{key: value for key, value in config_json.items() if key in known}}

    @abstractmethod
    def signature(self, config: dict, data_type: str) -> Signature:
        """The transformer engine's inputs and outputs (data_type: the engine's, e.g. BF16)."""

    def warm_up_sample(self, config: dict, plan: ParallelPlan) -> dict[str, list[int]]:
        """The input shapes of the small all-zeros request Triton sends each instance of a transformer engine at load
        (every rank runs it: the model is ready once the ranks have met); check_request must take it. By default each
        variable dimension of the signature is cp_size, so that every context-parallel rank gets real tokens."""
        inputs, _ = self.signature(config, "FP32")
        return {spec.name: [plan.cp_size if d == -1 else d for d in spec.shape] for spec in inputs}

    @abstractmethod
    def example_request(self, config: dict, tokens: int, dtype: torch.dtype,
                        batch: int = 1) -> dict[str, torch.Tensor]:
        """A seeded request of `tokens` tokens (as check_request counts them), laid out as a typical one: for
        benchmarks and tests."""


# What every pipeline takes and answers beside its own inputs and outputs: the step cache (a JSON object as text:
# mdtriton.engine.step_cache; left out, the model's default from config.pbtxt's parameters, else none), the LoRA
# adapters merged into the transformer for this request (a JSON object of names and scales: mdtriton.lora; left out,
# none), and how many denoising steps ran every transformer block.
SHARED_INPUTS = (TensorSpec("cache", "STRING", (1,)), TensorSpec("loras", "STRING", (1,)))
SHARED_OUTPUTS = (TensorSpec("full_steps", "INT32", (1,)),)


class PipelinePart(ABC):
    """A family's whole diffusers pipeline, served as one model: the denoising loop on the server, the transformer
    our multi-rank engine, every other component loaded by diffusers from the pipeline's directory.

    The served model's inputs become the pipeline's call (`call_arguments`), its result the outputs (`outputs`).
    """

    diffusers_class: ClassVar[str]  # model_index.json's _class_name, e.g. "FluxPipeline"
    # The pipeline's transformer components, which become engines (in the engine directory's folders of these names)
    # where its model_index.json lists them: Wan 2.2 A14B has two experts.
    transformers: ClassVar[tuple[str, ...]] = ("transformer",)
    # Whether the pipeline runs a conditional and an unconditional transformer call per step (classifier-free
    # guidance), which guidance parallelism (a plan's cfg_size 2) runs on two rank groups at once.
    guidance_branches: ClassVar[bool] = False
    # Components loaded in float32 whatever the engine's data type (Wan's VAE, as diffusers' Wan examples load it);
    # the others in the engine's data type.
    float32_components: ClassVar[tuple[str, ...]] = ()
    request_timeout_s: ClassVar[float] = 300.0  # a request is a whole image or video: every step
    # The step cache methods its transformer runs (mdtriton.engine.step_cache): First Block Cache needs the module's
    # first_block, other_blocks and finish; TaylorSeer its keep_attention and given_attention.
    cache_methods: ClassVar[tuple[str, ...]] = ("first_block",)

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

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """What the request checks need to know of the directory beside the transformer's config (e.g. the VAE's
        scale factor); kept in the pipeline's manifest."""
        return {}

    @abstractmethod
    def check_request(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Raise RequestError, saying what to send instead, if the inputs are not a request the pipeline can run."""

    @abstractmethod
    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        """The diffusers pipeline's call arguments for a request (not its callbacks nor output_type)."""

    @abstractmethod
    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """The served outputs of the pipeline's result (called with output_type "pt"), on the pipeline's device: an
        engine answers on its communicator's device (mdtriton.engine.comm, the device contract)."""

    @abstractmethod
    def transformer(self, engine: TorchEngine, pipeline: Any) -> nn.Module:
        """A transformer engine, called as the pipeline (the diffusers pipeline it serves in) calls its diffusers
        transformer."""
