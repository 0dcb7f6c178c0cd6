"""Build one model version: engine (or pipeline) + model.py + config.pbtxt, written into a Triton model repository."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.checkpoint import Checkpoint, CheckpointError
from mdtriton.build_tools.engine_builder import RandomWeights, build_engine, full_shapes
from mdtriton.build_tools.model_config import model_config, version_policy
from mdtriton.build_tools.repository import (ENGINE_DIR, check_compatible, check_model_name, install_version,
                                              keep_model_settings, new_version_dir)
from mdtriton.engine.fp8 import Fp8Unsupported, check_fp8_device
from mdtriton.engine.manifest import FORMAT_VERSION, EngineError, EngineLimits, Manifest
from mdtriton.engine.memory import check_gpus_fit
from mdtriton.engine.step_cache import read_cache
from mdtriton.families import ANY_PIPELINE, EnginePart, PipelinePart, family, served_part
from mdtriton.pipeline.any_pipeline import AnyPipelinePart
from mdtriton.pipeline.fit import (MODEL_INDEX, check_pipeline_gpus_fit, components_bytes, is_component,
                                   ranks_components)
from mdtriton.pipeline.generic import DiffusersPipelinePart
from mdtriton.serving import DEFAULT_REQUEST_TIMEOUT_S



class BuildInterrupted(Exception):
    """The build was stopped; what it finished is kept for the next run of the same build."""


def build_model_version(repository: Path, name: str, request: BuildRequest) -> Path:
    """Write repository/name/version/ as the request describes (BuildRequest) and return its path: one path for every
    family, plan and data type, for transformer engines and pipelines alike.

    The version is assembled in a hidden folder named after the build's inputs (Triton ignores names that are not
    numbers) and renamed into place at the end, so a failed build never leaves a half version, and the same build
    run again resumes from that folder.
    """
    check_model_name(name)
    # The inputs read more than once below, or replaced (the data type of an FP8 build, the default timeout).
    architecture_name, plan, data_type, device = (request.architecture_name, request.plan, request.data_type,
                                                  request.device)
    weights_path, request_timeout_s = request.weights_path, request.request_timeout_s
    if request_timeout_s is not None and not (math.isfinite(request_timeout_s) and request_timeout_s > 0):
        raise ValueError(f"request timeout {request_timeout_s:g} s: give a positive number of seconds (the longest a "
                         "request may wait for all ranks; default "
                         f"{DEFAULT_REQUEST_TIMEOUT_S:g}, a pipeline's {PipelinePart.request_timeout_s:g})")
    if architecture_name == ANY_PIPELINE:
        if weights_path is None:
            raise CheckpointError(f"{ANY_PIPELINE} builds from a diffusers pipeline directory: give it with --weights "
                                  "DIR")
        part = AnyPipelinePart.of_directory(Path(weights_path))
    else:
        part = served_part(architecture_name)
    if isinstance(part, DiffusersPipelinePart):
        return build_diffusers_pipeline(Path(repository), name, part, request)
    model_family = family(architecture_name)
    limits = request.limits or EngineLimits(max_tokens=model_family.max_tokens)
    # The transformer engines to build: (folder of the engine directory, checkpoint or None for random weights).
    if isinstance(part, EnginePart):
        pipeline_dir, engines = None, [("", Checkpoint(weights_path) if weights_path else None)]
        from_checkpoint = model_family.config_from_diffusers(engines[0][1].config()) if weights_path else {}
    else:
        if weights_path is None:
            raise CheckpointError(f"{architecture_name} builds from a diffusers {part.diffusers_class} directory: "
                                  "give it with --weights DIR")
        pipeline_dir = Path(weights_path)
        folders = transformer_folders(pipeline_dir, part)
        engines = [(folder, None if request.random_transformer else Checkpoint(pipeline_dir / folder))
                   for folder in folders]
        from_checkpoint = model_family.config_from_diffusers(
            json.loads((pipeline_dir / folders[0] / "config.json").read_text()))
    config = {**model_family.default_config(), **from_checkpoint, **(request.config or {})}
    model_family.check_plan(config, plan)
    if plan.cfg_size > 1 and not part.guidance_branches:
        raise ValueError(f"{architecture_name} has no classifier-free guidance branches to run on separate ranks "
                         "(guidance parallelism splits a guiding pipeline's two transformer calls per step: "
                         "wan-pipeline); build it with --cfg 1")
    quantization = "fp8" if data_type == "FP8" else None
    if quantization:
        data_type = "BF16"
        if not model_family.supports_fp8:
            raise EngineError(f"architecture {architecture_name!r} has no FP8 weights; build it with --dtype BF16")
        if device != "gpu":
            raise Fp8Unsupported("FP8 engines run on GPUs of compute capability 8.9 or newer; build with "
                                 "--device gpu, or with --dtype FP32 for CPU instances")
    inputs, outputs = model_family.signature(config, data_type)
    transformer = Manifest(model_family.name, config, plan, data_type, inputs, outputs, quantization=quantization)
    served = part.served_manifest(architecture_name, transformer, pipeline_dir, limits)
    if request_timeout_s is None:
        request_timeout_s = part.request_timeout_s
    triton_config = model_config(name, served, device, request.gpus, request_timeout_s)
    if isinstance(part, PipelinePart):
        serve_as_pipeline(triton_config, part, request.stream, request.cache)
    elif request.stream or request.cache is not None:
        raise ValueError(f"{architecture_name} is a transformer engine, which answers each request once and caches no "
                         "steps; --stream and --cache are for pipeline models (an architecture ending in -pipeline)")
    model_dir = prepare_model_dir(Path(repository), name, request.version, triton_config, request.policy)
    if device == "gpu":
        gpus = list(triton_config.instance_group[0].gpus)
        if isinstance(part, PipelinePart):  # the transformer engines with the pipeline's other components
            components = components_bytes(pipeline_dir, data_type, part.float32_components, part.transformers)
            check_pipeline_gpus_fit(ranks_components(components, part, plan),
                                    {folder: transformer for folder, _ in engines}, model_family, data_type, gpus)
        else:
            check_gpus_fit(transformer, model_family, gpus)
        if quantization and torch.cuda.is_available():
            for gpu in gpus:
                if gpu < torch.cuda.device_count():
                    check_fp8_device(torch.device("cuda", gpu))
    shapes = full_shapes(model_family.name, config)
    sources = {}
    for index, (folder, checkpoint) in enumerate(engines):
        if checkpoint:
            checkpoint.check(shapes, model_family.unused_weights)
        sources[folder] = checkpoint or RandomWeights(shapes, request.seed + index, request.random_device)
    # The engine format is an input too: a build an older mdtriton left unfinished (other file names) is not resumed.
    staging = staging_dir(model_dir, {"format_version": FORMAT_VERSION, "architecture": architecture_name,
                                      "config": served.config, "plan": plan.to_dict(), "data_type": data_type,
                                      "quantization": quantization,
                                      "weights": [source.fingerprint() for source in sources.values()]})
    engine_dir = staging / ENGINE_DIR
    with resumable(staging):
        for folder, source in sources.items():
            build_engine(engine_dir / folder, model_family.name, config, plan, data_type, source, request.progress,
                         limits, quantization)
        if isinstance(part, PipelinePart):
            copy_components(pipeline_dir, engine_dir, part)
            served.write(engine_dir)
    return finish_version(Path(repository), name, request.version, staging, triton_config)


def build_diffusers_pipeline(repository: Path, name: str, part: DiffusersPipelinePart, request: BuildRequest) -> Path:
    """A pipeline served with diffusers' own transformer (mdtriton.pipeline.generic): its directory copied whole
    (the transformer too: every rank loads it and keeps its share of each forward; each file hard-linked where the file
    system allows, so a 57 GB Qwen-Image directory takes no second copy of the disk), with the served manifest."""
    if request.weights_path is None:
        raise CheckpointError(f"{request.architecture_name} builds from a diffusers {part.diffusers_class} directory: "
                              "give it with --weights DIR")
    pipeline_dir = Path(request.weights_path)
    check_pipeline_dir(pipeline_dir, part)
    transformer_class = part.check_build(pipeline_dir, request.plan, request.data_type)
    inputs, outputs = part.served_signature()
    served = Manifest(request.architecture_name,
                      {"transformer_class": transformer_class, **part.pipeline_config(pipeline_dir)},
                      request.plan, request.data_type, inputs, outputs, limits=request.limits or EngineLimits())
    triton_config = model_config(name, served, request.device, request.gpus,
                                 part.request_timeout_s if request.request_timeout_s is None
                                 else request.request_timeout_s)
    serve_as_pipeline(triton_config, part, request.stream, request.cache)
    model_dir = prepare_model_dir(repository, name, request.version, triton_config, request.policy)
    if request.device == "gpu":  # every rank holds every component, diffusers' transformer too (but one-rank ones)
        components = components_bytes(pipeline_dir, request.data_type, part.float32_components)
        check_pipeline_gpus_fit(ranks_components(components, part, request.plan), {}, None, request.data_type,
                                list(triton_config.instance_group[0].gpus))
    staging = staging_dir(model_dir, {"format_version": FORMAT_VERSION, "architecture": request.architecture_name,
                                      "config": served.config, "plan": request.plan.to_dict(),
                                      "data_type": request.data_type, "weights": str(pipeline_dir.resolve())})
    engine_dir = staging / ENGINE_DIR
    with resumable(staging):
        shutil.copytree(pipeline_dir, engine_dir, copy_function=link_or_copy, dirs_exist_ok=True)
        served.write(engine_dir)
    return finish_version(repository, name, request.version, staging, triton_config)


def link_or_copy(source: str, destination: str) -> None:
    """destination as a hard link to source, or a copy of it where the file systems differ (or it is there already,
    from a build that stopped)."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def check_pipeline_dir(pipeline_dir: Path, part: PipelinePart) -> list[str]:
    """The components a diffusers directory of part's pipeline lists (model_index.json), after checking that it is
    one, with a folder for each; CheckpointError says what to pass otherwise."""
    index_path = pipeline_dir / MODEL_INDEX
    if not index_path.is_file():
        raise CheckpointError(f"{pipeline_dir}: no {MODEL_INDEX}; pass a diffusers {part.diffusers_class} directory")
    index = json.loads(index_path.read_text())
    if index.get("_class_name") != part.diffusers_class:
        raise CheckpointError(f"{index_path}: a {index.get('_class_name')!r}, not a {part.diffusers_class} directory")
    listed = [name for name, value in index.items() if not name.startswith("_") and is_component(value)]
    missing = [folder for folder in listed if not (pipeline_dir / folder).is_dir()]
    if missing:
        raise CheckpointError(f"{pipeline_dir}: component folder(s) {missing} missing; its {MODEL_INDEX} lists "
                              f"{', '.join(listed)}")
    return listed


def transformer_folders(pipeline_dir: Path, part: PipelinePart) -> list[str]:
    """The transformers of a diffusers directory of part's pipeline that become engines (Wan 2.2 A14B: two
    experts), after checking that it is one, with every component its model_index.json lists; CheckpointError says
    what to pass otherwise."""
    listed = check_pipeline_dir(pipeline_dir, part)
    folders = [folder for folder in part.transformers if folder in listed]
    if not folders:
        raise CheckpointError(f"{pipeline_dir / MODEL_INDEX} lists no {' or '.join(part.transformers)}; a {part.diffusers_class} "
                              "directory holds its transformer")
    return folders


def copy_components(pipeline_dir: Path, engine_dir: Path, part: PipelinePart) -> None:
    """Copy every component but the transformers into the pipeline's engine directory, and its model_index.json
    with the transformers' entries null: diffusers then loads every other component and leaves the transformers,
    which our engines serve, to the pipeline engine (mdtriton.pipeline.engine)."""
    index = json.loads((pipeline_dir / MODEL_INDEX).read_text())
    for folder, value in index.items():
        if not folder.startswith("_") and is_component(value) and folder not in part.transformers:
            shutil.copytree(pipeline_dir / folder, engine_dir / folder, dirs_exist_ok=True)
    served = {folder: [None, None] if folder in part.transformers else value for folder, value in index.items()}
    (engine_dir / MODEL_INDEX).write_text(json.dumps(served, indent=2) + "\n")


def serve_as_pipeline(triton_config: mc.ModelConfig, part: PipelinePart, stream: bool, cache: str | None) -> None:
    """A pipeline model answers each request once, or with stream is decoupled (one progress response per step,
    then the result); it has no warm-up (the ranks meet at the first request, which waits for them up to the request
    timeout); every input but the prompt is optional; cache, if given, is the step cache of requests without one."""
    triton_config.model_transaction_policy.decoupled = stream
    for model_input in triton_config.input:
        model_input.optional = model_input.name in part.served_optional_inputs()
    if cache is not None:
        try:
            config = read_cache(cache)
        except ValueError as error:
            raise ValueError(f"--cache: {error}") from None
        if config is not None and config.method not in part.cache_methods:
            raise ValueError(f"--cache: method {config.method!r} is not offered by this model; its methods: "
                             f"{', '.join(part.cache_methods + ('none',))}"
                             + (f" ({part.cache_note})" if part.cache_note else ""))
        triton_config.parameters["cache"].string_value = cache


def prepare_model_dir(repository: Path, name: str, version: int | None, triton_config: mc.ModelConfig,
                      policy: str | None) -> Path:
    """The model's folder, after checking (before any work) that the version is new and that the model's config
    takes the new version; triton_config gets the policy and keeps the model's own settings."""
    new_version_dir(repository, name, version)
    model_dir = repository / name
    check_compatible(model_dir, triton_config)
    if policy is not None:
        triton_config.version_policy.CopyFrom(version_policy(policy))
    keep_model_settings(model_dir, triton_config)
    return model_dir


def staging_dir(model_dir: Path, build_inputs: dict) -> Path:
    """The hidden folder a build assembles its version in, named after the build's inputs (so a rerun resumes)."""
    key = json.dumps(build_inputs, sort_keys=True)
    return model_dir / f".building-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@contextmanager
def resumable(staging: Path) -> Iterator[None]:
    """A stopped build (Ctrl-C) says where its finished work is kept."""
    try:
        yield
    except KeyboardInterrupt:
        raise BuildInterrupted(f"build interrupted; its finished weight files are kept in {staging}: run the same "
                               "command again to resume") from None


def finish_version(repository: Path, name: str, version: int | None, staging: Path,
                   triton_config: mc.ModelConfig) -> Path:
    """Add model.py and the config to the assembled version and rename it to its version number."""
    install_version(staging, triton_config)
    version_dir = new_version_dir(repository, name, version)
    staging.rename(version_dir)
    return version_dir
