"""Build a FLUX pipeline model version from a diffusers FLUX directory (FLUX.1-dev's or FLUX.1-schnell's layout).

The transformer becomes our multi-rank engine (any plan and data type), in `engine/transformer/`; the other
components (scheduler, CLIP and T5 text encoders and their tokenizers, VAE) are copied beside it unchanged,
with model_index.json, and `engine/manifest.json` describes the pipeline: its signature
(mdtriton.pipeline.signature), plan, data type and limits. One decoupled Triton model serves it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.build_tools.build import finish_version, prepare_model_dir, resumable, staging_dir
from mdtriton.build_tools.checkpoint import Checkpoint, CheckpointError
from mdtriton.build_tools.engine_builder import RandomWeights, build_engine, full_shapes
from mdtriton.build_tools.model_config import model_config
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.engine.manifest import EngineLimits, Manifest
from mdtriton.engine.memory import check_gpus_fit
from mdtriton.engine.models.flux import Flux
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.signature import ARCHITECTURE, COMPONENTS, OPTIONAL_INPUTS, TRANSFORMER_DIR, pipeline_signature

MODEL_INDEX = "model_index.json"
# A request is the whole image (every step), so it may take much longer than one transformer call.
PIPELINE_REQUEST_TIMEOUT_S = 300.0


def read_pipeline_dir(pipeline_dir: Path) -> tuple[dict, int]:
    """(transformer config, VAE scale factor) of a diffusers FLUX directory, after checking it holds every part."""
    index_path = pipeline_dir / MODEL_INDEX
    if not index_path.is_file():
        raise CheckpointError(f"{pipeline_dir}: no {MODEL_INDEX}; pass a diffusers FLUX pipeline directory "
                              "(e.g. a download of black-forest-labs/FLUX.1-dev)")
    index = json.loads(index_path.read_text())
    if index.get("_class_name") != "FluxPipeline":
        raise CheckpointError(f"{index_path}: a {index.get('_class_name')!r}, not a FluxPipeline directory")
    missing = [part for part in COMPONENTS + (TRANSFORMER_DIR,) if not (pipeline_dir / part).is_dir()]
    if missing:
        raise CheckpointError(f"{pipeline_dir}: component folder(s) {missing} missing; a FLUX pipeline directory holds "
                              f"{', '.join(COMPONENTS + (TRANSFORMER_DIR,))}")
    known = Flux.default_config()
    transformer_config = json.loads((pipeline_dir / TRANSFORMER_DIR / "config.json").read_text())
    config = {**known, **{key: value for key, value in transformer_config.items() if key in known}}
    vae_config = json.loads((pipeline_dir / "vae" / "config.json").read_text())
    return config, 2 ** (len(vae_config["block_out_channels"]) - 1)


def pipeline_manifest(transformer_config: dict, vae_scale_factor: int, plan: ParallelPlan, data_type: str,
                      limits: EngineLimits) -> Manifest:
    inputs, outputs = pipeline_signature()
    config = {"transformer": transformer_config, "vae_scale_factor": vae_scale_factor}
    return Manifest(ARCHITECTURE, config, plan, data_type, inputs, outputs, limits=limits)


def pipeline_model_config(name: str, manifest: Manifest, device: str, gpus: list[int] | None,
                          request_timeout_s: float) -> mc.ModelConfig:
    """The ranks' config, decoupled (one progress response per step, then the image), without a warm-up.

    A warm-up request would need a data file per input and run the whole pipeline at load; instead the ranks
    meet at the first request, which waits for them (up to the request timeout).
    """
    config = model_config(name, manifest, device, gpus, request_timeout_s)
    config.ClearField("model_warmup")
    config.model_transaction_policy.decoupled = True
    for model_input in config.input:
        model_input.optional = model_input.name in OPTIONAL_INPUTS
    return config


def build_pipeline_version(repository: Path, name: str, pipeline_dir: Path, plan: ParallelPlan, data_type: str,
                           device: str, gpus: list[int] | None = None, version: int | None = None,
                           request_timeout_s: float = PIPELINE_REQUEST_TIMEOUT_S, progress: bool = True,
                           policy: str | None = None, limits: EngineLimits = EngineLimits(),
                           transformer_weights: RandomWeights | None = None) -> Path:
    """Write repository/name/version/ for the FLUX pipeline in pipeline_dir and return its path (resumable, like
    build_tools.build.build_model_version).

    transformer_weights: random weights for the transformer instead of the directory's checkpoint (whose
    `transformer/` then needs only its config.json): FLUX.1-dev-size benchmarks without a 24 GB download.
    """
    pipeline_dir = Path(pipeline_dir)
    config, vae_scale_factor = read_pipeline_dir(pipeline_dir)
    Flux.check_plan(config, plan)
    manifest = pipeline_manifest(config, vae_scale_factor, plan, data_type, limits)
    triton_config = pipeline_model_config(name, manifest, device, gpus, request_timeout_s)
    model_dir = prepare_model_dir(Path(repository), name, version, triton_config, policy)
    inputs, outputs = Flux.signature(config, data_type)
    if device == "gpu":
        check_gpus_fit(Manifest("flux", config, plan, data_type, inputs, outputs),
                       list(triton_config.instance_group[0].gpus))
    source = transformer_weights or Checkpoint(pipeline_dir / TRANSFORMER_DIR)
    if transformer_weights is None:
        source.check(full_shapes("flux", config))
    staging = staging_dir(model_dir, {"architecture": ARCHITECTURE, "config": manifest.config, "plan": plan.to_dict(),
                                      "data_type": data_type, "weights": source.fingerprint()})
    engine_dir = staging / ENGINE_DIR
    with resumable(staging):
        build_engine(engine_dir / TRANSFORMER_DIR, "flux", config, plan, data_type, source, progress, limits)
        for component in COMPONENTS:
            shutil.copytree(pipeline_dir / component, engine_dir / component, dirs_exist_ok=True)
        shutil.copyfile(pipeline_dir / MODEL_INDEX, engine_dir / MODEL_INDEX)
        manifest.write(engine_dir)
    return finish_version(Path(repository), name, version, staging, triton_config)
