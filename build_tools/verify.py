"""`mdtriton verify`: check a built model version's weight files against their manifest, SHA-256 included.

A load checks each weight file's size and safetensors header only (reading no weights); this reads every byte, so
it also finds damage inside the tensors. Run it after copying a repository, or when a model answers strangely.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.engine.manifest import MANIFEST_FILE, EngineError, Manifest
from mdtriton.families import served_part


def weights_engine_dirs(version_dir: Path) -> list[Path]:
    """The engine directories of a model version that hold weight files: its transformer engines' (a pipeline's in
    folders of its engine directory)."""
    engine_dir = Path(version_dir) / ENGINE_DIR
    manifest = Manifest.read(engine_dir)
    part = served_part(manifest.architecture, manifest.config)
    return [engine_dir / folder for folder in part.transformers if (engine_dir / folder / MANIFEST_FILE).is_file()]


def verify_version(version_dir: Path) -> list[str]:
    """One line per weight file of version_dir: "ok PATH", or the error that names the file and what is wrong."""
    lines = []
    for engine_dir in weights_engine_dirs(version_dir):
        manifest = Manifest.read(engine_dir)
        for rank in range(len(manifest.weights)):  # rank r loads file r (the first rank of its shard)
            try:
                lines.append(f"ok {manifest.verified_weight_file(engine_dir, rank)}")
            except EngineError as error:
                lines.append(f"FAILED {error}")
    return lines


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify", help="check a model version's weight files, SHA-256 included",
        description="Check every weight file of built model versions against their manifest: size, safetensors header, "
                    "and SHA-256 (a load checks the first two only, to read no weights). Exit code 1 if any fails.")
    parser.add_argument("version_dirs", nargs="+", type=Path, metavar="VERSION_DIR",
                        help="a model version directory, REPOSITORY/NAME/VERSION")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    lines = [line for version_dir in args.version_dirs for line in verify_version(version_dir)]
    print("\n".join(lines))
    return 1 if any(line.startswith("FAILED") for line in lines) else 0
