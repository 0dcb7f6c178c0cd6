"""docs/client.md lists each pipeline's inputs with their defaults, by hand: they must be the ones the pipelines take
(PipelinePart.optional_inputs), so a changed default cannot leave the docs behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mdtriton.families import served_part

CLIENT_DOCS = Path(__file__).resolve().parent.parent / "docs" / "client.md"
SECTIONS = {"flux-pipeline": "## Prompt to image (FLUX pipelines)",
            "wan-pipeline": "## Prompt to video (Wan pipelines)",
            "flux-kontext-pipeline": "## FLUX.1 Kontext: an image edited by a prompt",
            "wan-i2v-pipeline": "## Image to video (Wan image-to-video pipelines)"}


def what_travels(architecture: str) -> str:
    """The "What travels" paragraph of the architecture's section, in one line."""
    text = CLIENT_DOCS.read_text()
    section = text[text.index(SECTIONS[architecture]):]
    section = section[:section.index("\n## ", 1)]
    paragraph = section[section.index("What travels"):]
    return " ".join(paragraph.split("\n\n")[0].split())


@pytest.mark.parametrize("architecture", sorted(SECTIONS))
def test_the_documented_defaults_are_the_pipelines(architecture):
    paragraph = what_travels(architecture)
    optional = served_part(architecture).optional_inputs()
    defaults = {name: value for name, value in optional.items() if value is not None}
    assert defaults
    for name, value in defaults.items():
        assert f"`{name}`" in paragraph, name
        after = paragraph[paragraph.index(f"`{name}`"):]
        documented = re.search(r"\(([^)]*)\)", after).group(1)  # the first parenthesis after the name
        assert documented == str(value), f"{name}: docs/client.md says ({documented}), the pipeline takes {value}"
