"""The README as a new user follows it: every `mdtriton` command in it is one the CLI's own parser takes (parsed, not
run), and its Python snippet runs against a served model."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from mdtriton.cli import make_parser

README = Path(__file__).resolve().parent.parent / "README.md"
SHELL_SEPARATORS = {"&&", "||", ";", "|", "&"}


def code_blocks(text: str) -> tuple[list[str], list[str]]:
    """The README's shell lines (indented blocks and fenced blocks other than Python's, continuations joined) and its
    Python snippets."""
    shell, python = [], []
    for language, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        if language == "python":
            python.append(body)
        else:
            shell += body.splitlines()
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    indented = "\n".join(line[4:] for line in text.splitlines() if line.startswith("    "))
    shell += indented.replace("\\\n", " ").splitlines()
    return shell, python


def mdtriton_commands(line: str) -> list[list[str]]:
    """The argument lists of the `mdtriton` commands in a shell line (those chained with && and the like too)."""
    commands, current = [], []
    for token in shlex.split(line, comments=True) + ["&&"]:
        if token in SHELL_SEPARATORS:
            if current[:1] == ["mdtriton"]:
                commands.append(current[1:])
            current = []
        else:
            current.append(token)
    return commands


def parse(argv: list[str]) -> str:
    """'' if the CLI's parser takes argv (a --help counts), else its error message."""
    errors, output = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(output):
        try:
            make_parser(argv[0] if argv else None).parse_args(argv)
        except SystemExit as stop:
            return "" if stop.code == 0 else errors.getvalue().strip().splitlines()[-1]
    return ""


def readme_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every `mdtriton` command in the README: in its code blocks, and in its inline code."""
    text = README.read_text()
    shell, _ = code_blocks(text)
    found = [("code block", argv) for line in shell for argv in mdtriton_commands(line)]
    inline = re.findall(r"`(mdtriton [^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL))
    found += [("inline", argv) for span in inline for argv in mdtriton_commands(" ".join(span.split()))]
    return found


def test_the_readme_has_its_first_run_in_order():
    commands = [" ".join(argv[:1]) for where, argv in readme_commands() if where == "code block"]
    first_run = ["build", "serve", "health", "models", "infer", "metadata"]
    assert [command for command in commands if command in first_run][:len(first_run)] == first_run
    assert "huggingface-cli" not in README.read_text()


def test_every_mdtriton_command_of_the_readme_parses():
    """Code blocks hold whole commands; inline code may name a command (`mdtriton lora add`: at most two words, no
    option), which must then be one (its --help parses)."""
    commands = readme_commands()
    assert len(commands) > 15
    wrong = []
    for where, argv in commands:
        named_only = where == "inline" and len(argv) <= 2 and not any(arg.startswith("-") for arg in argv)
        error = parse(argv + ["--help"] if named_only else argv)
        if error:
            wrong.append(f"{where}: mdtriton {shlex.join(argv)}: {error}")
    assert wrong == []


def test_the_parse_check_finds_a_wrong_command():
    assert "unrecognized arguments: --no-such-flag" in parse(["health", "--no-such-flag"])
    assert "invalid choice" in parse(["lora", "adds", "--help"])


@pytest.mark.timeout(300)
def test_the_readme_python_snippet_runs(served_models, capsys):
    """Against the shared server, which serves "tiny" as the README builds it (hidden size 64)."""
    _, python = code_blocks(README.read_text())
    assert python
    for snippet in python:
        assert "127.0.0.1:8001" in snippet
        exec(compile(snippet.replace("127.0.0.1:8001", served_models.grpc_address), str(README), "exec"), {})
    assert capsys.readouterr().out.strip() == "(1, 16, 64)"
