"""The package's layers point one way (docs/architecture.md, "Layers"): a module imports only from its own part and
from the layers below. Every import statement of the package's source is read with `ast`, those inside functions and
`if TYPE_CHECKING:` blocks too, so no import can dodge the rule by being made late."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE_DOCS = ROOT / "docs" / "architecture.md"

# Bottom up. The parts of one layer do not import each other; "mdtriton" is the package's own modules (the command
# line, the embedded server, the demo, the benchmark harness) and what tests and benchmarks share, above everything.
LAYERS = (
    ("mdtriton.engine",),
    ("mdtriton.lora",),
    ("mdtriton.pipeline",),
    ("mdtriton.families",),
    ("mdtriton.serving",),
    ("mdtriton.backend", "mdtriton.build_tools", "mdtriton.client"),
    ("mdtriton", "mdtriton.testing"),
)
LAYER_OF = {part: index for index, parts in enumerate(LAYERS) for part in parts}


def package_sources() -> dict[str, Path]:
    """Every module of the installed package by its dotted name, from pyproject.toml's package directories."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, directory in package_dirs.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = path.relative_to(ROOT / directory).with_suffix("").parts
            modules[".".join((package,) + parts).removesuffix(".__init__")] = path
    return modules


def part_of(module: str) -> str:
    """The part (a key of LAYER_OF) a module belongs to: the longest one its name starts with."""
    return max((part for part in LAYER_OF if module == part or module.startswith(part + ".")), key=len)


def imported_modules(module: str, path: Path, source: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) of each mdtriton module the source of `module` (at path) imports; `from P import N` counts as
    P.N where that is a module (`from mdtriton.build_tools import verify`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per dot after the first
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
                      for alias in node.names]
    return [(line, name) for line, name in dict.fromkeys(found) if name == "mdtriton" or name.startswith("mdtriton.")]


def upward_imports(sources: dict[str, tuple[Path, str]]) -> list[str]:
    """Each import, by a module of `sources` ({module: (path, source)}), of a part in a layer above its own or of
    another part of its layer, described."""
    known = set(sources)
    wrong = []
    for module, (path, source) in sources.items():
        own = part_of(module)
        for line, target in imported_modules(module, path, source, known):
            other = part_of(target)
            if other != own and LAYER_OF[other] >= LAYER_OF[own]:
                where = "its own layer" if LAYER_OF[other] == LAYER_OF[own] else "a layer above"
                wrong.append(f"{path}:{line}: {module} imports "
                             f"{target}, of {other} ({where}: layer {LAYER_OF[other] + 1}, {own} is in layer "
                             f"{LAYER_OF[own] + 1})")
    return wrong


def test_no_module_imports_from_a_layer_above_its_own():
    sources = {module: (path.relative_to(ROOT), path.read_text()) for module, path in package_sources().items()}
    assert "mdtriton.engine.engine" in sources and "mdtriton.backend.rank_model" in sources
    assert upward_imports(sources) == []


def test_every_package_under_mdtriton_is_placed_in_a_layer():
    """A new package must be given its layer here (and in the docs), not fall into the top one unseen."""
    packages = {module for module, path in package_sources().items() if path.name == "__init__.py"}
    unplaced = [package for package in packages if package.count(".") == 1 and package not in LAYER_OF]
    assert unplaced == []


def test_an_upward_import_is_found_wherever_it_is_made():
    engine_module = Path("mdtriton/engine/example.py")
    sources = {
        "mdtriton.engine.example": (engine_module, "from mdtriton.families import family\n"),
        "mdtriton.engine.late": (engine_module, "def load():\n    import mdtriton.pipeline.engine\n"),
        "mdtriton.engine.typed": (engine_module, "if TYPE_CHECKING:\n    from mdtriton.serving import load_engine\n"),
        "mdtriton.lora.relative": (Path("mdtriton/lora/relative.py"), "from ..pipeline import prompts\n"),
        "mdtriton.backend.sibling": (Path("backend/sibling.py"), "from mdtriton.build_tools import build\n"),
        "mdtriton.families.fine": (Path("mdtriton/families/fine.py"), "from mdtriton.engine.plan import ParallelPlan\n"
                                                                       "from mdtriton.families import family\n"),
    }
    wrong = upward_imports(sources)
    assert [entry.split(" imports ")[0].split(": ")[1] for entry in wrong] == [
        "mdtriton.engine.example", "mdtriton.engine.late", "mdtriton.engine.typed", "mdtriton.lora.relative",
        "mdtriton.backend.sibling"]
    assert "of mdtriton.families (a layer above: layer 4, mdtriton.engine is in layer 1)" in wrong[0]
    assert "of mdtriton.build_tools (its own layer" in wrong[-1]


def test_the_docs_list_the_layers_in_order():
    text = ARCHITECTURE_DOCS.read_text()
    section = text[text.index("\n## Layers\n"):]
    section = section[:section.index("\n## ", 1)]
    items = re.findall(r"^\d+\. (.*?):", section, flags=re.MULTILINE)
    documented = tuple(tuple(re.findall(r"`(mdtriton[a-z_.]*)`", item)) for item in items)
    assert documented == LAYERS
