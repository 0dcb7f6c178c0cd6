"""The repository speaks of the product, not of how it was made: no tracked text file (this one included) names the
numbered work periods, the measuring machines' loans and kind names, internal issue numbers or numbered measuring runs
(WORDS below, assembled from parts so that this file does not spell them). Upstream references (Triton server#8882,
python_backend PR #384, vLLM-Omni issues #427) and technical uses (subprocess's start_new_session, pytest's test
session) are the product's words and pass."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Assembled from parts, so that this file, which is tracked too, does not spell the words it looks for.
SESSION = "ses" + "sion"
WORDS = [
    rf"\b{SESSION}s? \d",  # a numbered work period
    rf"\b(this|that|next|last|previous|each|every|the first|the second|the third|the fourth|the fifth) "
    rf"{SESSION}\b",
    rf"\b{SESSION}s\b",
    "nvidia" + r"-h\d",  # the machines' kind names
    r"\bdevice (tool|calls?)\b",
    r"\b" + "lea" + r"s(e|es|ed)\b",
    r"\b" + "iss" + r"ue #?\d",  # our own numbers; upstream ones are "server#8882", "issues #427"
    r"\bthe " + "iss" + r"ue's\b",
    r"\bnot " + "ke" + r"pt\b",
    r"\bcalls? ((?-i:[A-G])|\d{1,2})(\b|-)(?! ?(s|ms)\b)",  # a run named by its number or letter
]
# The technical uses of the word: an OS process's, pytest's whole run and its fixtures' scope.
TECHNICAL = re.compile(rf"start_new_{SESSION}|scope=\"{SESSION}\"|{SESSION}_rendezvous_root|"
                       rf"\b(test|process|HTTP|gRPC) {SESSION}\b", re.IGNORECASE)
PATTERN = re.compile("|".join(f"(?:{word})" for word in WORDS), re.IGNORECASE)


def tracked_text_files(root: Path) -> list[Path]:
    """Every file git tracks under root that reads as UTF-8 text (images and other binaries are skipped)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout
    files = []
    for name in names.decode().split("\0"):
        path = root / name
        if name and path.is_file():
            data = path.read_bytes()
            if b"\0" not in data:
                try:
                    data.decode()
                except UnicodeDecodeError:
                    continue
                files.append(path)
    return files


def process_words(root: Path) -> list[str]:
    """file:line: text, for every line of a tracked text file that speaks of how the project was made."""
    found = []
    for path in tracked_text_files(root):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            match = PATTERN.search(TECHNICAL.sub("", line))
            if match:
                found.append(f"{path.relative_to(root)}:{number}: {match.group(0)!r} in {line.strip()[:120]}")
    return found


def test_no_tracked_file_speaks_of_how_the_project_was_made():
    found = process_words(ROOT)
    assert not found, "words about how the project was made (say what the product does instead):\n" + "\n".join(found)


def test_the_words_are_found_and_upstream_references_pass(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    bad = [f"measured in {SESSION} 27", "on the nvidia" + "-h200-x4 kind", "one device" + " call", "(iss" + "ue 36)",
           "tried and not " + "kept", "the " + "lea" + "se ran out", "ca" + "ll 3 below"]
    good = ["Triton server#8882 and python_backend PR #384", "vLLM-Omni issues #427", "start_new_" + SESSION + "=True",
            f"every server of the test {SESSION}", "the first calls 113 s", "a call that finds the server UNAVAILABLE"]
    (tmp_path / "notes.md").write_text("\n".join(bad + good) + "\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\0 " + SESSION.encode() + b" 27")
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    found = process_words(tmp_path)
    assert [entry.split(":")[1] for entry in found] == [str(line) for line in range(1, len(bad) + 1)], found
