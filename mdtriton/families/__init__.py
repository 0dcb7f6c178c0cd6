"""The registry of model families: the one place that maps an architecture name to what it is.

Built-in families are listed here; a user's package adds its own through the `mdtriton.families` entry point
group (pyproject.toml: `[project.entry-points."mdtriton.families"] toy = "my_package.toy:TOY"`, the object a
`Family` instance), so the build, the server's stubs and the rank workers all find it once it is installed.
Architecture names: a family's name for its transformer engine, `<name>-pipeline` for its pipeline, and the names of
its further pipelines (`Family.more_pipelines`: FLUX's "flux-kontext-pipeline", Wan's "wan-i2v-pipeline"). Pipelines
served with diffusers' own transformer, split by its own context-parallel plan, have no family: each declares only
its request (DIFFUSERS_PIPELINES, mdtriton.pipeline.generic); any other diffusers pipeline is served as
`diffusers-pipeline`, its request read off its call at build time (mdtriton.pipeline.any_pipeline).
"""

from __future__ import annotations

import importlib
from functools import cache
from importlib.metadata import entry_points

from mdtriton.engine.manifest import EngineError
from mdtriton.families.family import Family, PipelinePart, RequestSize
from mdtriton.pipeline.any_pipeline import ANY_PIPELINE, AnyPipelinePart
from mdtriton.pipeline.generic import DiffusersPipelinePart
from mdtriton.pipeline.part import EnginePart, ServedPart

__all__ = ["Family", "EnginePart", "PipelinePart", "ServedPart", "RequestSize", "families", "family", "served_part",
           "architecture_names", "diffusers_pipelines", "more_pipelines", "is_diffusers_pipeline", "ANY_PIPELINE"]

ENTRY_POINT_GROUP = "mdtriton.families"
BUILT_IN = ("mdtriton.families.tiny_transformer:TINY_TRANSFORMER", "mdtriton.families.flux:FLUX",
            "mdtriton.families.wan:WAN",
            "mdtriton.families.cosmos3:COSMOS3")
PIPELINE_SUFFIX = "-pipeline"
# Pipelines served with diffusers' own transformer (no family of ours), by architecture name.
DIFFUSERS_PIPELINES = {"qwen-image-pipeline": "mdtriton.families.qwen_image:QWEN_IMAGE",
                       "flux2-klein-pipeline": "mdtriton.families.flux2:FLUX2_KLEIN",
                       "flux2-pipeline": "mdtriton.families.flux2:FLUX2",
                       "qwen-image-edit-plus-pipeline": "mdtriton.families.qwen_image_edit_plus:QWEN_IMAGE_EDIT_PLUS",
                       "flux-kontext-generic-pipeline": "mdtriton.families.flux_kontext_generic:FLUX_KONTEXT_GENERIC",
                       "ltx2-pipeline": "mdtriton.families.ltx2:LTX2",
                       "ltx2-image-to-video-pipeline": "mdtriton.families.ltx2:LTX2_IMAGE_TO_VIDEO"}


def _load(reference: str, origin: str) -> Family:
    module_name, _, attribute = reference.partition(":")
    found = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(found, Family):
        raise EngineError(f"{origin} {reference!r} is a {type(found).__name__}, not an mdtriton Family instance")
    return found


@cache
def families() -> dict[str, Family]:
    """Every registered family by name: the built-in ones, then those of installed packages' entry points."""
    found: dict[str, Family] = {}
    loaded = [(_load(reference, "built-in family"), "mdtriton") for reference in BUILT_IN]
    for point in entry_points(group=ENTRY_POINT_GROUP):
        loaded.append((_load(point.value, f"entry point {point.name!r} of group {ENTRY_POINT_GROUP}"),
                       point.dist.name if point.dist else point.value))
    for item, origin in loaded:
        if item.name in found or item.name.endswith(PIPELINE_SUFFIX):
            raise EngineError(f"family name {item.name!r} (from {origin}) is taken or ends in {PIPELINE_SUFFIX!r}; "
                              "give the family another name")
        found[item.name] = item
    return found


@cache
def more_pipelines() -> dict[str, tuple[Family, PipelinePart]]:
    """The families' further pipelines (Family.more_pipelines), by architecture name, each with its family."""
    found = {}
    for item in families().values():
        for name, part in item.more_pipelines.items():
            if name in found or name.removesuffix(PIPELINE_SUFFIX) in families():
                raise EngineError(f"pipeline name {name!r} of family {item.name!r} is taken; give it another name")
            found[name] = (item, part)
    return found


@cache
def diffusers_pipelines() -> dict[str, DiffusersPipelinePart]:
    """The pipelines served with diffusers' own transformer, by architecture name."""
    found = {}
    for name, reference in DIFFUSERS_PIPELINES.items():
        module_name, _, attribute = reference.partition(":")
        found[name] = getattr(importlib.import_module(module_name), attribute)
    return found


def is_diffusers_pipeline(architecture: str) -> bool:
    """Whether an architecture is a pipeline served with diffusers' own transformer (no family of ours)."""
    return architecture in DIFFUSERS_PIPELINES or architecture == ANY_PIPELINE


def architecture_names() -> list[str]:
    """Every architecture a build can make: each family's, `<name>-pipeline` for those with a pipeline, and the
    pipelines served with diffusers' own transformer."""
    names = []
    for name, item in families().items():
        names += [name] + ([name + PIPELINE_SUFFIX] if item.pipeline is not None else [])
    return names + list(more_pipelines()) + list(DIFFUSERS_PIPELINES) + [ANY_PIPELINE]


def family(architecture: str) -> Family:
    """The family of an architecture name (its transformer engine's or one of its pipelines')."""
    if architecture in more_pipelines():
        return more_pipelines()[architecture][0]
    name = architecture.removesuffix(PIPELINE_SUFFIX)
    item = families().get(name)
    if item is None or (name != architecture and item.pipeline is None):
        raise EngineError(f"unknown architecture {architecture!r}; known: {', '.join(architecture_names())} "
                          f"(a family from another package must be installed: entry point group {ENTRY_POINT_GROUP})")
    return item


def served_part(architecture: str, config: dict | None = None) -> ServedPart:
    """What the model of an architecture name serves: its pipeline, or the family's transformer engine (EnginePart);
    config: the served manifest's, which holds the request of a `diffusers-pipeline` (read off its call at build
    time)."""
    if architecture == ANY_PIPELINE:
        if config is None or "call" not in config:
            raise EngineError(f"{ANY_PIPELINE}: its manifest's config holds no call; build it again")
        return AnyPipelinePart(config["call"])
    if architecture in DIFFUSERS_PIPELINES:
        return diffusers_pipelines()[architecture]
    if architecture in more_pipelines():
        return more_pipelines()[architecture][1]
    item = family(architecture)
    return item.pipeline if architecture.endswith(PIPELINE_SUFFIX) else EnginePart(item)
