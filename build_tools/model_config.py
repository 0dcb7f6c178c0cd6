"""config.pbtxt for an mdtriton model, made from Triton's own protobuf schema (model_config.proto)."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.engine.manifest import Manifest
from mdtriton.families import family, served_part

# The instance group's name: Triton names CPU instances "<name>_<i>", which the backend reads as the rank.
RANK_GROUP = "rank"
WARMUP_NAME = "all_ranks_together"


def model_config(name: str, manifest: Manifest, device: str, gpus: list[int] | None,
                 request_timeout_s: float) -> mc.ModelConfig:
    """One instance per rank: on GPU one per listed GPU (rank = position in the list), on CPU N instances.

    max_batch_size is 0: the engines take the batch as an explicit first dimension, and FLUX's position
    ids (img_ids, txt_ids) have no batch dimension at all, so Triton's dynamic batcher (which needs
    max_batch_size > 0 and a batch dimension on every input) does not apply; clients batch themselves.
    The parameters tell users what they are talking to (architecture, data type, parallel plan), and what the
    served part adds (ServedPart.model_parameters: a pipeline's request_defaults, what a request that leaves an input
    out gets).
    """
    part = served_part(manifest.architecture, manifest.config)
    world_size = manifest.plan.world_size
    if device == "gpu":
        gpus = list(range(world_size)) if gpus is None else list(gpus)
        if len(gpus) != world_size or len(set(gpus)) != len(gpus):
            raise ValueError(f"the engine has {world_size} ranks: give {world_size} distinct GPUs, got {gpus}")
        group = mc.ModelInstanceGroup(name=RANK_GROUP, kind=mc.ModelInstanceGroup.KIND_GPU, count=1, gpus=gpus)
    elif device == "cpu":
        group = mc.ModelInstanceGroup(name=RANK_GROUP, kind=mc.ModelInstanceGroup.KIND_CPU, count=world_size)
    else:
        raise ValueError(f"device must be 'gpu' or 'cpu', got {device!r}")
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=0, instance_group=[group])
    for spec in manifest.inputs:
        config.input.append(mc.ModelInput(name=spec.name, data_type=mc.DataType.Value(f"TYPE_{spec.data_type}"),
                                          dims=list(spec.shape)))
    for spec in manifest.outputs:
        config.output.append(mc.ModelOutput(name=spec.name, data_type=mc.DataType.Value(f"TYPE_{spec.data_type}"),
                                            dims=list(spec.shape)))
    if part.warmed_up_at_load:
        config.model_warmup.append(warmup(manifest))
    parameters = {
        "engine_dir": "engine",
        "request_timeout_s": str(request_timeout_s),
        "architecture": manifest.architecture,
        "data_type": manifest.data_type,
        "parallel_plan": str(manifest.plan),
        **part.model_parameters(),
    }
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def warmup(manifest: Manifest) -> mc.ModelWarmup:
    """One small all-zeros request that Triton sends to each instance while it loads the model.

    Every rank runs every job, so each instance's warm-up job runs on all ranks: the model turns READY
    only once all ranks have joined and run a job together (on GPU this also creates the NCCL
    communicators, which otherwise the first user request would wait for). It cannot deadlock: Triton
    initialises the Python backend's instances in parallel, and a rank runs other instances' jobs in its
    job thread while its own warm-up waits; a rank that never joins fails the warm-up after the
    request timeout.

    Its shapes are the family's (Family.warm_up_sample: by default each variable dimension cp_size, so that every
    context-parallel rank gets real tokens).
    """
    dims = family(manifest.architecture).warm_up_sample(manifest.config, manifest.plan)
    sample = mc.ModelWarmup(name=WARMUP_NAME, batch_size=1)
    for spec in manifest.inputs:
        sample.inputs[spec.name].CopyFrom(mc.ModelWarmup.Input(
            data_type=mc.DataType.Value(f"TYPE_{spec.data_type}"), dims=dims[spec.name], zero_data=True))
    return sample


def version_policy(text: str) -> mc.ModelVersionPolicy:
    """Triton's version_policy from 'all', 'latest:K' or 'specific:V1,V2,...'."""
    kind, _, value = text.partition(":")
    try:
        if kind == "all" and not value:
            return mc.ModelVersionPolicy(all=mc.ModelVersionPolicy.All())
        if kind == "latest":
            count = int(value)
            if count >= 1:
                return mc.ModelVersionPolicy(latest=mc.ModelVersionPolicy.Latest(num_versions=count))
        if kind == "specific":
            versions = sorted({int(v) for v in value.split(",")})
            if versions and versions[0] >= 1:
                return mc.ModelVersionPolicy(specific=mc.ModelVersionPolicy.Specific(versions=versions))
    except ValueError:
        pass
    raise ValueError(f"version policy {text!r}: use 'all', 'latest:K' (K >= 1) or 'specific:V1,V2,...' (versions >= 1)")


def write_model_config(path: Path, config: mc.ModelConfig) -> None:
    Path(path).write_text(text_format.MessageToString(config))


def read_model_config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())
