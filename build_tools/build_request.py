"""What describes one model version to build: the inputs of `mdtriton build` (build_tools/build.py) as one value."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from mdtriton.engine.manifest import EngineLimits
from mdtriton.engine.plan import ParallelPlan


@dataclass(frozen=True)
class BuildRequest:
    """One version of a model to build: what it computes (architecture, config, plan, data type), where it runs,
    where its weights come from, and how Triton serves it. The defaults are `mdtriton build`'s."""

    # A family's name (a transformer engine) or `<family>-pipeline` (the family's whole diffusers pipeline, from the
    # diffusers directory at weights_path: its transformer becomes the engine, in `engine/transformer/` (and each
    # other transformer it lists, e.g. Wan 2.2's `transformer_2`, beside it), its other components are copied
    # unchanged, and `engine/manifest.json` describes the served pipeline).
    architecture_name: str
    # The architecture's config, over the family's defaults and a checkpoint's config.json; None: those alone.
    config: dict | None
    # How the ranks split the model (tensor, context and guidance parallelism; elastic groups).
    plan: ParallelPlan
    # FP32, FP16, BF16 or FP8: the blocks' linear weights in e4m3 with row scales, the rest (and inputs, outputs) in
    # BF16; FP8 only for GPUs that run FP8 GEMMs (compute capability 8.9+), refused for CPU instances or other GPUs.
    data_type: str
    # "cpu" (KIND_CPU instances, gloo) or "gpu" (one KIND_GPU instance per GPU).
    device: str
    _: KW_ONLY
    # The GPU ids of the ranks, in rank order; None: 0..N-1.
    gpus: list[int] | None = None
    # Weights: random from seed (a pipeline's with random_transformer: seed, seed + 1, ... for its transformers),
    # generated on random_device ("cpu" or "cuda"), unless weights_path gives a checkpoint (a pipeline's: its
    # diffusers directory, whose transformer folders are the checkpoints; a config.json fills the config).
    seed: int = 0
    weights_path: Path | None = None
    # The version number; None: the next free one.
    version: int | None = None
    # The longest a request may wait for all ranks; None is the default (a pipeline's is longer: a request is a
    # whole image).
    request_timeout_s: float | None = None
    # Whether the build reports its progress as it writes weights.
    progress: bool = True
    random_device: str = "cpu"
    # The model's version_policy ('all', 'latest:K', 'specific:V1,V2'); None keeps the model's current one (Triton's
    # default, latest:1, for a new model). Parameters added to the model's config by hand (e.g. EXECUTION_ENV_PATH)
    # are kept either way.
    policy: str | None = None
    # None is the default batch limit and the family's token limit.
    limits: EngineLimits | None = None
    # A pipeline's transformers from random weights (seed) instead of its directory's transformer folders.
    random_transformer: bool = False
    # Pipelines only: the model is decoupled and streams a progress response per denoising step before its result;
    # without it the model answers each request once (unary gRPC infer, HTTP/JSON, perf_analyzer's default).
    stream: bool = False
    # Pipelines only: the step cache of requests that send none, a JSON object as the `cache` input takes
    # (mdtriton.engine.step_cache), kept in config.pbtxt's parameters; the build raises ValueError if it is not one.
    cache: str | None = None
