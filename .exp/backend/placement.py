"""Which rank this Triton model instance is, and on which device, from the arguments Triton gives it."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


class PlacementError(Exception):
    """The model's instances cannot be mapped onto the engine's ranks."""


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    device: torch.device


def placement_from_args(args: dict, config: dict) -> Placement:
    """On GPU: rank = position of this instance's GPU in the instance group's `gpus` list.

    On CPU: Triton names the instances of a group of count N "<group>_0" .. "<group>_<N-1>";
    the number is the rank, which keeps ranks distinct and stable across stub restarts.
    """
    groups = config.get("instance_group", [])
    if len(groups) != 1:
        raise PlacementError(f"an mdtriton model needs exactly one instance_group (one instance per rank), found {len(groups)}")
    group = groups[0]
    if args["model_instance_kind"] == "GPU":
        gpus = [int(g) for g in group.get("gpus", [])]
        if int(group.get("count", 1)) != 1 or not gpus:
            raise PlacementError("on GPU the instance_group must be {count: 1, kind: KIND_GPU, gpus: [0, 1, ...]}: one instance per GPU")
        device_id = int(args["model_instance_device_id"])
        visible = torch.cuda.device_count()
        if max(gpus) >= visible:
            raise PlacementError(f"instance_group asks for GPUs {gpus} but only {visible} are visible to this process")
        return Placement(gpus.index(device_id), len(gpus), torch.device("cuda", device_id))
    count = int(group.get("count", 1))
    name = args["model_instance_name"]
    if count == 1:
        return Placement(0, 1, torch.device("cpu"))
    match = re.fullmatch(re.escape(group.get("name", "")) + r"_(\d+)", name)
    if not match:
        raise PlacementError(f"cannot read a rank from instance name {name!r}; expected {group.get('name')}_<rank>")
    return Placement(int(match.group(1)), count, torch.device("cpu"))
