"""What the pipeline engine needs of a family's pipeline: the `PipelinePart` a family declares (mdtriton.families)
and the inputs and outputs every served pipeline has beside its own."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest, Signature, TensorSpec


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

    def load_arguments(self, pipeline_dir: Path) -> dict:
        """Arguments of the pipeline's `from_pretrained` beside the components (e.g. a component left out where the
        environment lacks its package, or one built from pipeline_dir otherwise); read when a rank loads the
        pipeline."""
        return {}

    def prepare(self, pipeline: Any, comm: Communicator, compiled: bool) -> None:
        """Make the loaded pipeline ready on this rank, before its transformers are set (a pipeline that splits
        diffusers' own transformer splits it here, and compiles it if compiled: GPU ranks); by default nothing."""

    def before_call(self, pipeline: Any, arguments: dict) -> None:
        """Ready the pipeline for one request's call with arguments (call_arguments'); by default nothing."""

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """What the request checks need to know of the directory beside the transformer's config (e.g. the VAE's
        scale factor); kept in the pipeline's manifest."""
        return {}

    @abstractmethod
    def check_request(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Raise RequestError, saying what to send instead, if the inputs are not a request the pipeline can run."""

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
