"""Full (unsplit) weights read from a safetensors checkpoint one slice at a time.

A checkpoint is one `.safetensors` file, the index of a sharded one (`*.safetensors.index.json`, as
diffusers and transformers write them), or a directory holding either (and, in diffusers' layout, the
model's `config.json`). Each rank's build reads only its own slices of each weight through
safetensors' memory-mapped slices, so no step holds the whole model in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mdtriton.engine.layers import shard_ranges

Split = tuple[int, list[int], int, int]  # (dim, segments, tp_rank, tp_size), as layers.parallel_specs gives


class CheckpointError(Exception):
    """A checkpoint that cannot be read, or does not hold the weights the architecture needs."""


def _index_files(path: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError) as error:
        raise CheckpointError(f"{path}: not a safetensors index (needs a 'weight_map'): {error}") from error
    return {name: path.parent / file for name, file in weight_map.items()}


def _single_file(path: Path) -> dict[str, Path]:
    try:
        with safe_open(path, "pt") as handle:
            return {name: path for name in handle.keys()}
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from error


class Checkpoint:
    """Weight names, shapes and slices of a safetensors checkpoint."""

    def __init__(self, path: Path):
        path = Path(path)
        if path.is_dir():
            indexes = sorted(path.glob("*.safetensors.index.json"))
            files = sorted(path.glob("*.safetensors"))
            if len(indexes) > 1:
                raise CheckpointError(f"{path}: several safetensors indexes ({', '.join(p.name for p in indexes)}); "
                                      "pass the one to use")
            if not indexes and len(files) != 1:
                raise CheckpointError(f"{path}: expected one .safetensors file or one *.safetensors.index.json, "
                                      f"found {len(files)} .safetensors files and no index")
            path = indexes[0] if indexes else files[0]
        if not path.is_file():
            raise CheckpointError(f"{path}: no such checkpoint file")
        self.path = path
        self.directory = path.parent
        self.file_of = _index_files(path) if path.name.endswith(".json") else _single_file(path)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.file_of.values())):
            if not file.is_file():
                raise CheckpointError(f"{file}: listed in {path.name} but missing")
            with safe_open(file, "pt") as handle:
                for name in handle.keys():
                    if self.file_of.get(name) == file:
                        self.shapes[name] = tuple(handle.get_slice(name).get_shape())
        missing = sorted(set(self.file_of) - set(self.shapes))
        if missing:
            raise CheckpointError(f"{path}: weights {missing[:5]} are listed but not in their files")

    def config(self) -> dict:
        """The model's config.json beside the weights (diffusers' layout), or {} if there is none."""
        path = self.directory / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def check(self, expected_shapes: dict[str, tuple[int, ...]], unused: tuple[str, ...] = ()) -> None:
        """Raise CheckpointError unless the checkpoint holds exactly these weights, with these full shapes, besides
        weights whose names start with one of `unused` (the family's Family.unused_weights, never read)."""
        missing = sorted(set(expected_shapes) - set(self.shapes))
        unexpected = sorted(name for name in set(self.shapes) - set(expected_shapes) if not name.startswith(unused))
        wrong = [f"{name} {self.shapes[name]} (expected {shape})" for name, shape in expected_shapes.items()
                 if name in self.shapes and self.shapes[name] != shape]
        problems = []
        if missing:
            problems.append(f"{len(missing)} weights missing, e.g. {missing[:3]}")
        if unexpected:
            problems.append(f"{len(unexpected)} weights the architecture does not have, e.g. {unexpected[:3]}")
        if wrong:
            problems.append(f"{len(wrong)} weights of another shape, e.g. {wrong[:3]}")
        if problems:
            raise CheckpointError(f"{self.path} does not fit the architecture's config: {'; '.join(problems)}. "
                                  "Check --config against the checkpoint's config.json")

    def read(self, name: str, split: Split | None = None) -> torch.Tensor:
        """The weight, or only this rank's ranges of its split dimension; read from disk slice by slice."""
        with safe_open(self.file_of[name], "pt") as handle:
            tensor_slice = handle.get_slice(name)
            if split is None:
                return tensor_slice[:]
            dim, segments, tp_rank, tp_size = split
            lead = (slice(None),) * dim
            parts = [tensor_slice[lead + (slice(start, stop),)] for start, stop in shard_ranges(segments, tp_rank, tp_size)]
        return torch.cat(parts, dim=dim)

    def fingerprint(self) -> dict:
        """What identifies this checkpoint's contents for resuming a build: its files' names, sizes and times."""
        files = sorted(set(self.file_of.values()))
        return {"checkpoint": str(self.path.resolve()),
                "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
