"""config.pbtxt for an mdtriton model, made from Triton's own protobuf schema (model_config.proto)."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from mdtriton.engine.manifest import Manifest

# The instance group's name: Triton names CPU instances "<name>_<i>", which the backend reads as the rank.
RANK_GROUP = "rank"


def model_config(name: str, manifest: Manifest, device: str, gpus: list[int] | None = None,
                 request_timeout_s: float = 300.0) -> mc.ModelConfig:
    """One instance per rank: on GPU one per listed GPU (rank = position in the list), on CPU N instances."""
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
    parameters = {
        "engine_dir": "engine",
        "request_timeout_s": str(request_timeout_s),
        "parallel_plan": str(manifest.plan),
    }
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def write_model_config(path: Path, config: mc.ModelConfig) -> None:
    Path(path).write_text(text_format.MessageToString(config))


def read_model_config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())

