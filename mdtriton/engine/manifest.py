"""The engine manifest: what an engine directory holds and how its ranks split the model.

An engine directory is `manifest.json` plus one safetensors file per tensor-parallel shard (`shard{t}.safetensors`):
a rank's weights depend on its tensor-parallel index only, so the ranks that hold the same shard (its CFG and
context-parallel replicas) read the same file, and a plan without tensor parallelism keeps one copy of the model, not
one per rank. (Formats 2 and 3 kept one file per rank, `rank{r}.safetensors`; they still load.) The manifest carries
each file's size and SHA-256: a load checks what costs no read of the weights (the size, and the safetensors header,
which names the file's shard and plan), so a truncated, replaced or swapped file is caught before it can serve a
request; the SHA-256, which costs a read of the whole file (23 GB per shard for FLUX.1-dev), is checked by
`mdtriton verify` and by a build that resumes. The manifest also
records the engine's limits (largest batch, longest sequence), which the server checks before a request reaches any
rank.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError, safe_open

from mdtriton.engine.plan import ParallelPlan

# 2: limits added. 3: quantization added (version 2 reads as unquantized). 4: one weight file per tensor-parallel
# shard, shared by the ranks that hold it (versions 2 and 3: one per rank).
FORMAT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)
SHARED_SHARDS_VERSION = 4
MANIFEST_FILE = "manifest.json"
# Defaults of the limits: FLUX at 2048x2048 pixels is 16384 image tokens plus up to 512 text tokens.
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_TOKENS = 32768
# Triton's data type names (as in tritonclient and the HTTP/gRPC protocol) that engines may use.
# STRING: Triton's TYPE_STRING (BYTES), text inputs of pipelines, which reach the ranks as UTF-8 rows (UINT8).
DATA_TYPES = ("FP32", "FP16", "BF16", "INT64", "INT32", "UINT8", "STRING")
# How an engine's weights may be stored other than in its data type: "fp8" = the blocks' linear weights in
# e4m3 with one float32 scale per output row, activations quantized per token (mdtriton.engine.fp8).
QUANTIZATIONS = ("fp8",)
# The safetensors metadata key of a weight file that names its shard and plan (Manifest.file_label).
RANK_FILE_KEY = "mdtriton"


class EngineError(Exception):
    """An engine directory that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: name, Triton data type and shape (-1 for a dimension that varies)."""

    name: str
    data_type: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.data_type not in DATA_TYPES:
            raise ValueError(f"tensor {self.name!r}: data type {self.data_type!r} is not one of {DATA_TYPES}")

    def to_dict(self) -> dict:
        return {"name": self.name, "data_type": self.data_type, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict) -> "TensorSpec":
        return cls(data["name"], data["data_type"], tuple(int(d) for d in data["shape"]))


Signature = tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]  # an engine's (inputs, outputs)


@dataclass(frozen=True)
class EngineLimits:
    """The largest request the engine takes: batch size, and tokens in one sequence (FLUX: text + image).

    The server refuses larger requests (INVALID_ARG) before any rank sees them, so one oversized request
    cannot run every GPU out of memory; set them at build time (`mdtriton build --max-batch-size/--max-tokens`).
    """

    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_tokens: int = DEFAULT_MAX_TOKENS

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_tokens < 1:
            raise ValueError(f"max_batch_size and max_tokens must be >= 1, got {self.max_batch_size} and {self.max_tokens}")


@dataclass(frozen=True)
class WeightFile:
    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    architecture: str
    config: dict
    plan: ParallelPlan
    data_type: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weights: tuple[WeightFile, ...] = field(default=())
    limits: EngineLimits = field(default=EngineLimits())
    quantization: str | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not one of {QUANTIZATIONS}")

    @property
    def weight_type(self) -> str:
        """The weights' precision, for people: FP8 for an fp8 engine, else the data type."""
        return "FP8" if self.quantization == "fp8" else self.data_type

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "architecture": self.architecture,
            "config": self.config,
            "plan": self.plan.to_dict(),
            "data_type": self.data_type,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "weights": [vars(w) for w in self.weights],
            "limits": vars(self.limits),
            "quantization": self.quantization,
        }

    def write(self, engine_dir: Path) -> None:
        (Path(engine_dir) / MANIFEST_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, engine_dir: Path) -> "Manifest":
        path = Path(engine_dir) / MANIFEST_FILE
        if not path.is_file():
            raise EngineError(f"{path}: no engine manifest here (build one with `mdtriton build`)")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise EngineError(f"{path}: unreadable manifest: {error}") from error
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            advice = ("made by a newer mdtriton: upgrade mdtriton, or rebuild the engine with this one"
                      if isinstance(version, int) and version > FORMAT_VERSION
                      else "rebuild the engine with this mdtriton (`mdtriton build`)")
            raise EngineError(f"{path}: engine format version {version} is not supported by this mdtriton "
                              f"(it reads versions {', '.join(map(str, READABLE_VERSIONS))}); {advice}")
        try:
            return cls(
                architecture=data["architecture"],
                config=data["config"],
                plan=ParallelPlan.from_dict(data["plan"]),
                data_type=data["data_type"],
                inputs=tuple(TensorSpec.from_dict(t) for t in data["inputs"]),
                outputs=tuple(TensorSpec.from_dict(t) for t in data["outputs"]),
                weights=tuple(WeightFile(**w) for w in data["weights"]),
                limits=EngineLimits(**data["limits"]),
                quantization=data.get("quantization"),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise EngineError(f"{path}: malformed manifest: {error!r}") from error

    @property
    def shares_shard_files(self) -> bool:
        """One weight file per tensor-parallel shard, shared by its replicas (format 4 on); else one per rank."""
        return self.format_version >= SHARED_SHARDS_VERSION

    def file_index(self, rank: int) -> int:
        """Which of `weights` rank loads: its tensor-parallel index (the shard its replicas share), or in formats 2 and
        3 the rank's own file."""
        return self.plan.tp_rank(rank) if self.shares_shard_files else rank

    def file_label(self, index: int) -> str:
        """What weight file `index`'s header says it holds (metadata RANK_FILE_KEY), written by the build, checked at
        load: "tp shard 1 of world 4 = ..." (formats 2 and 3: "rank 1 of world 4 = ...")."""
        if self.shares_shard_files:
            return f"tp shard {index} of {self.plan}"
        return f"rank {index} of {self.plan}"

    def weight_file(self, engine_dir: Path, rank: int) -> Path:
        """The path of rank's weights, after the checks that read no weights: the file exists, has the manifest's
        size, and its safetensors header parses, fits the file's size and names rank's shard of this plan (a file of
        another shard has the same size when the plan splits evenly). Damaged tensor bytes pass these checks: the
        SHA-256 finds them (verified_weight_file, `mdtriton verify`)."""
        files = self.plan.tp_size if self.shares_shard_files else self.plan.world_size
        if len(self.weights) != files:
            raise EngineError(f"{engine_dir}: manifest lists {len(self.weights)} weight files, "
                              f"{self.plan} needs {files}")
        entry = self.weights[self.file_index(rank)]
        path = Path(engine_dir) / entry.file
        if not path.is_file():
            raise EngineError(f"{path}: weight file of rank {rank} is missing")
        size = path.stat().st_size
        if size != entry.bytes:
            raise EngineError(f"{path}: weight file of rank {rank} has {size} bytes, manifest says {entry.bytes} "
                              "(truncated or replaced; rebuild the engine)")
        try:
            with safe_open(path, "pt") as handle:
                label = (handle.metadata() or {}).get(RANK_FILE_KEY)
        except SafetensorError as error:
            raise EngineError(f"{path}: not a readable safetensors file: {error}") from error
        expected = self.file_label(self.file_index(rank))
        if label != expected:
            raise EngineError(f"{path}: weight file of rank {rank} says it holds {label!r}, not {expected!r} "
                              "(swapped, or from another engine; rebuild the engine)")
        return path

    def verified_weight_file(self, engine_dir: Path, rank: int) -> Path:
        """weight_file, with the file's SHA-256 checked against the manifest's too: reads the whole file."""
        path = self.weight_file(engine_dir, rank)
        if file_sha256(path) != self.weights[self.file_index(rank)].sha256:
            raise EngineError(f"{path}: weight file of rank {rank} fails its checksum (corrupted; rebuild the engine)")
        return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()
