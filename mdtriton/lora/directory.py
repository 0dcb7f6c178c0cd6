"""Where a model's adapters are kept: `MODEL/loras/NAME.safetensors` in its repository, beside its numbered versions
(Triton ignores a model's folders that are not numbers). The stub checks a request's names here; the ranks read the
files from here when a request first names them; `mdtriton lora` writes here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ADAPTERS_DIR = "loras"
SUFFIX = ".safetensors"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# The adapters' factors each rank keeps loaded between requests, the most recently used first (one rank-64 adapter
# on every projection of FLUX.1-dev is about 0.6 GiB in bf16).
DEFAULT_CACHE_MIB = 4096


def adapters_dir(model_dir: Path) -> Path:
    return Path(model_dir) / ADAPTERS_DIR


def check_name(name: str) -> None:
    """ValueError unless name can name an adapter: 1 to 100 letters, digits, '.', '_' or '-', starting with a letter
    or digit, without '..' (a file name on every system, and no path)."""
    if not NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"adapter name {name!r}: use 1 to 100 letters, digits, '.', '_' or '-', starting with a "
                         "letter or digit, without '..'")


def adapter_path(directory: Path, name: str) -> Path:
    """The file of adapter `name` in an adapters directory (checked name)."""
    check_name(name)
    return Path(directory) / f"{name}{SUFFIX}"


def adapter_names(directory: Path) -> list[str]:
    """The adapters kept in directory, sorted."""
    if not Path(directory).is_dir():
        return []
    return sorted(path.name.removesuffix(SUFFIX) for path in Path(directory).iterdir()
                  if path.name.endswith(SUFFIX) and NAME.fullmatch(path.name.removesuffix(SUFFIX)))


@dataclass(frozen=True)
class AdapterSettings:
    """Where a served model's adapters are kept, and how much of them each rank keeps loaded (config.pbtxt's
    lora_cache_mib)."""

    directory: Path
    cache_mib: int = DEFAULT_CACHE_MIB
