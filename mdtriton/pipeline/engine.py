"""The pipeline engine: a family's diffusers pipeline on every rank, its transformer split across the ranks.

diffusers loads every component but the transformer from the engine directory, as the pipeline's
`model_index.json` lists them (tokenizers, text encoders, scheduler, VAE), and the pipeline runs as diffusers
runs it, so an image equals diffusers' for the same components; its `transformer` is our multi-rank engine
behind the family's adapter. Every rank runs the whole pipeline on the same inputs: the other components are
replicated (deterministic, so the ranks agree without sending anything; but a part's one-rank components, FLUX.2
[dev]'s text encoder, whose prompts rank 0 encodes and broadcasts: mdtriton.pipeline.encoder), and the
transformer's collectives keep the ranks in step. The VAE decode is split across the ranks by bands of rows
(mdtriton.pipeline.split_vae). The ranks agree before the first transformer call that none failed before it, and
after each step whether to stop (mdtriton.engine.job_control): a request that fails there, or is cancelled, ends on
every rank at once and leaves them serving.
"""

from __future__ import annotations

import importlib
import logging
from contextlib import nullcontext
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from mdtriton.engine.architecture import Architecture
from mdtriton.engine.comm import Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.engine import Engine, TorchEngine
from mdtriton.engine.group_times import GroupTimes
from mdtriton.engine.manifest import MANIFEST_FILE, EngineError, Manifest
from mdtriton.engine.job_control import JobAgreement
from mdtriton.engine.request_check import RequestError
from mdtriton.engine.step_cache import StepCache
from mdtriton.lora.adapter_file import AdapterError
from mdtriton.lora.directory import AdapterSettings
from mdtriton.lora.weights import AdapterWeights
from mdtriton.pipeline.diffusers_cache import DiffusersStepCache
from mdtriton.pipeline.encoder import ENCODING_RANK, encode_on_one_rank
from mdtriton.pipeline.fit import check_pipeline_fits, components_bytes, listed_components
from mdtriton.pipeline.part import PipelinePart
from mdtriton.pipeline.request_checks import loras_of, step_cache_of
from mdtriton.pipeline.split_vae import split_decode
from mdtriton.pipeline.transformer import EngineAsTransformer

log = logging.getLogger(__name__)


class PipelineEngine(Engine):
    """One rank's pipeline: the replicated components and its shard of the transformer."""

    def __init__(self, manifest: Manifest, part: PipelinePart, pipeline: DiffusionPipeline, comm: Communicator,
                 transformers: list[EngineAsTransformer], warm_up_seconds: float, adapters: AdapterWeights | None):
        self.manifest = manifest
        self.part = part
        self.pipeline = pipeline
        self.comm = comm
        self.transformers = transformers
        self.warm_up_seconds = warm_up_seconds
        self.adapters = adapters
        self.agreement: JobAgreement | None = None  # the running job's, while it runs
        if not transformers:  # diffusers' own transformer (mdtriton.pipeline.generic): the ranks agree at its call
            pipeline.transformer.register_forward_pre_hook(lambda module, args: self.before_collectives())
        if part.encodes_on_one_rank(comm.plan):  # the prompts encoded on one rank, broadcast after an agreement
            encode_on_one_rank(pipeline, comm, lambda: self.agreement)

    @classmethod
    def load(cls, engine_dir: Path, manifest: Manifest, architecture: Architecture, comm: Communicator,
             part: PipelinePart, adapters: AdapterSettings | None = None,
             compile: bool | None = None) -> "PipelineEngine":
        """Load this rank's transformer shard and the pipeline's other components from engine_dir (no download);
        manifest: engine_dir's, read by the caller (the transformer's own manifest is read here); architecture: its
        transformer's family. Requests may name
        the adapters kept where `adapters` says; they change the pipeline's first transformer (`transformer`, as
        diffusers' LoRA loaders do). compile: None compiles on GPUs only, as TorchEngine.load does (our engines, and
        diffusers' own transformer as the part prepares it). On a GPU, EngineError before anything is loaded if the
        rank does not fit the GPU's free memory (mdtriton.pipeline.fit)."""
        # Prompts are user data: diffusers' and transformers' truncation warnings would quote them in the server log.
        # Their loading progress bars would fill it, one line per component and rank.
        for library_logging in (diffusers_logging, transformers_logging):
            library_logging.set_verbosity_error()
            library_logging.disable_progress_bar()
        engine_dir = Path(engine_dir)
        engine_manifests = {folder: Manifest.read(engine_dir / folder)
                            for folder in transformer_engine_folders(engine_dir, part)}
        try:
            arguments = part.load_arguments(engine_dir)
            not_here = part.components_not_on(comm.plan, comm.rank)  # the text encoder where another rank encodes
            leave_out = (*part.transformers, *arguments, *not_here)  # our engines, and what the part gives itself
            if comm.device.type == "cuda":
                # Before anything is loaded: does a rank fit the GPU's free memory (mdtriton.pipeline.fit)?
                components = components_bytes(engine_dir, manifest.data_type, part.float32_components, leave_out)
                check_pipeline_fits(components, engine_manifests, architecture, manifest.data_type, comm.device.index,
                                    torch.cuda.mem_get_info(comm.device)[0], "free")
            dtypes = {"default": TORCH_DTYPES[manifest.data_type],
                      **dict.fromkeys(part.float32_components, torch.float32)}
            # On GPUs the models are read straight onto the rank's GPU (models_on_device); on CPU diffusers loads them.
            models = models_on_device(engine_dir, dtypes, comm.device, leave_out) if comm.device.type == "cuda" else {}
            pipeline = DiffusionPipeline.from_pretrained(engine_dir, **dict.fromkeys((*part.transformers, *not_here)),
                                                         **models, dtype=dtypes, local_files_only=True, **arguments)
        except (OSError, ValueError, TypeError) as error:
            raise EngineError(f"{engine_dir}: the pipeline's components do not load: {error}") from error
        if type(pipeline).__name__ != part.diffusers_class:
            raise EngineError(f"{engine_dir}: a {type(pipeline).__name__}, not the {part.diffusers_class} that "
                              f"{manifest.architecture} serves")
        log_encoding(part, comm, not_here)
        pipeline.to(comm.device)
        split_decode(pipeline.vae, comm)
        compiled = comm.device.type == "cuda" if compile is None else compile
        part.prepare(pipeline, comm, compiled)
        # The transformers last: each load checks that its shard fits the memory the other components left free.
        engines = {folder: TorchEngine.load(engine_dir / folder, engine_manifest, architecture, comm, compiled)
                   for folder, engine_manifest in engine_manifests.items()}
        transformers = [part.transformer(engine, pipeline) for engine in engines.values()]
        for folder, transformer in zip(engines, transformers):
            setattr(pipeline, folder, transformer)
        pipeline.set_progress_bar_config(disable=True)  # the server reports progress
        adapter_weights = None
        if adapters is not None:
            # Our first engine's module, or diffusers' own transformer (mdtriton.pipeline.generic): plain linear
            # layers of diffusers' names, whole on every rank.
            first = next(iter(engines.values()), None)
            adapter_weights = AdapterWeights(
                first.module if first is not None else pipeline.transformer, adapters.directory,
                adapters.cache_mib * 2**20, TORCH_DTYPES[(first.manifest if first is not None else manifest).data_type])
        return cls(manifest, part, pipeline, comm, transformers,
                   sum(engine.warm_up_seconds for engine in engines.values()), adapter_weights)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The request's outputs (the family's PipelinePart says which) and `full_steps`, progress reported after
        each step. Each transformer gets a step cache of its own for this request only (mdtriton.engine.step_cache;
        diffusers' own transformer gets diffusers' cache hooks for the call: mdtriton.pipeline.diffusers_cache);
        the request's adapters are merged into the transformer's weights first, or the base weights put back if it
        names none (mdtriton.lora.weights). JobFailed if a rank failed before the first transformer call (every rank
        raises it), JobStopped if the request's rank asked to stop after a step."""
        agreement = JobAgreement(self.comm)
        caches, own_cache = [], None
        self.agreement = agreement
        try:
            loras = loras_of(inputs)
            if self.adapters is not None:
                self.adapters.activate(loras)
            elif loras:
                raise RequestError("this pipeline was loaded without an adapters directory: its requests name no "
                                   "adapters")
            config = step_cache_of(inputs)
            caches = [StepCache(config) for _ in self.transformers]
            for transformer, cache in zip(self.transformers, caches):
                transformer.step_cache, transformer.agreement = cache, agreement

            def step_done(pipeline: DiffusionPipeline, step: int, timestep, callback_kwargs: dict) -> dict:
                agreement.step_done(step + 1, pipeline.num_timesteps, callback_kwargs.get("latents"))
                return callback_kwargs

            arguments = self.part.call_arguments(self.manifest, inputs)
            if not self.transformers:
                own_cache = DiffusersStepCache(self.pipeline.transformer, config, self.comm,
                                               self.part.cache_contexts(self.pipeline, arguments))
            self.part.before_call(self.pipeline, arguments)
            with own_cache or nullcontext():
                result = self.pipeline(**arguments, output_type="pt", callback_on_step_end=step_done)
            agreement.finish(self.pipeline.num_timesteps)
        except Exception as error:  # noqa: BLE001 - before the first collective, any failure is agreed on, then raised
            agreement.failed(*failure_message(error))
            raise
        finally:
            self.agreement = None
            for transformer in self.transformers:
                transformer.step_cache, transformer.agreement = None, None
        # Under guidance parallelism the conditional branch ran on guidance group 0 only: every rank answers its count.
        if own_cache is not None:
            ran = own_cache.full_steps(self.pipeline.num_timesteps)
        else:
            ran = sum(cache.full_steps for cache in caches)
        full_steps = torch.tensor([ran], dtype=torch.int32, device=self.comm.device)
        # Answered on this rank's device (mdtriton.engine.comm, the device contract): a moving no-op for outputs made
        # there, and a copy back for what a component hands back on the host (Cosmos 3's safety checker's frames).
        outputs = {name: tensor.to(self.comm.device)
                   for name, tensor in self.part.outputs_of(self.manifest, result).items()}
        return {**outputs, "full_steps": self.comm.cfg_all_gather(full_steps)[0]}

    def request_tokens(self, inputs: dict[str, torch.Tensor]) -> int | None:
        """The tokens of the request's transformer calls, as its family's part counts them (None if it does not)."""
        return self.part.request_tokens(self.manifest, inputs)

    def measure_group_times(self) -> GroupTimes | None:
        """The first transformer engine's times, up to the pipeline's token limit; a step's guided branches (guidance
        parallelism in the plan) count twice on a group too small to run them at once. None for diffusers' own
        transformer."""
        if not self.transformers:
            return None
        plan = self.comm.plan
        return self.transformers[0].engine.measure_group_times(
            self.manifest.limits.max_tokens, lambda size: plan.cfg_size // plan.group_plan(size).cfg_size)

    def before_collectives(self) -> None:
        """At the running job's first transformer call: the ranks agree that none failed before it."""
        if self.agreement is not None:
            self.agreement.before_collectives()


def models_on_device(engine_dir: Path, dtypes: dict[str, torch.dtype], device: torch.device,
                     leave_out: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    """The pipeline's diffusers and transformers models in engine_dir (text encoders, VAE, diffusers' own transformer;
    but leave_out's), each read by its class's from_pretrained straight onto device, in its dtype of dtypes (diffusers'
    per-component form): DiffusionPipeline.from_pretrained then takes them as given components.

    What it saves: loaded by the pipeline, every model is first made whole in host memory and then moved, so each rank
    holds a host copy of the whole pipeline while it loads (FLUX.2 [dev] in bf16: about 112 GB per rank, N ranks on one
    host at once); read onto the device, each weight file's tensors go to the GPU as they are read, and no rank holds
    a host copy. Each model is loaded with its own device_map, not the pipeline's: the pipeline takes only "cuda" (no
    GPU index), which transformers reads as GPU 0 (or $LOCAL_RANK's), not this rank's GPU. A device_map of one device
    adds no hooks, so the pipeline's later `.to(device)` is allowed (and moves nothing)."""
    models = {}
    for name, (library, class_name) in listed_components(engine_dir).items():
        if name in leave_out or library not in ("diffusers", "transformers"):
            continue
        model_class = getattr(importlib.import_module(library), class_name, None)
        if isinstance(model_class, type) and issubclass(model_class, torch.nn.Module):
            dtype = dtypes.get(name, dtypes["default"])
            models[name] = model_class.from_pretrained(Path(engine_dir) / name, dtype=dtype, device_map=str(device),
                                                       local_files_only=True)
    return models


def log_encoding(part: PipelinePart, comm: Communicator, not_here: tuple[str, ...]) -> None:
    """Say where the part's one-rank components are: left out on this rank, or on every rank of an elastic model."""
    plan = comm.plan
    if not_here:
        log.info("the pipeline loaded without its %s: rank %d encodes each request's prompts and broadcasts them",
                 ", ".join(not_here), ENCODING_RANK)
    elif part.one_rank_components and plan.elastic:
        log.info("every rank holds the %s: an elastic model's jobs run on groups of ranks that may not hold rank %d, "
                 "so each group encodes its own prompts", ", ".join(part.one_rank_components), ENCODING_RANK)


def transformer_engine_folders(engine_dir: Path, part: PipelinePart) -> list[str]:
    """The folders of a pipeline's engine directory that hold its transformer engines (the build made one for each
    transformer the pipeline's directory listed)."""
    return [folder for folder in part.transformers if (Path(engine_dir) / folder / MANIFEST_FILE).is_file()]


def failure_message(error: Exception) -> tuple[str, bool]:
    """What a request's answer says of a failure of its job on a rank, and whether the request was at fault: a
    RequestError, or an adapter it names that cannot be used (its file went, or is damaged)."""
    if isinstance(error, (RequestError, AdapterError)):
        return str(error), True
    return f"{type(error).__name__}: {error}", False
