"""README.md's short tour names only commands and flags simkv has: every `simkv ...` line of the
tour (and the option lines under it) is checked against the CLI's own commands and options."""

from __future__ import annotations

import re
from pathlib import Path

import click

from simkv.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"
_FLAG = re.compile(r"^--?[a-z][a-z0-9-]*$")


def _tour() -> list[str]:
    text = README.read_text()
    start = text.index("## A short tour")
    block = text[start:].split("```")[1]
    return [line for line in block.splitlines() if line.strip()]


def _commands() -> list[tuple[str, list[str]]]:
    """(the line, its words) for each tour command, continuation lines joined to theirs;
    comments and quoted strings (another tool's command line) dropped."""
    out: list[tuple[str, list[str]]] = []
    for line in _tour():
        code = line.split("#", 1)[0]
        words = [w.strip("[]|") for w in re.sub(r"\"[^\"]*\"|'[^']*'", "Q", code).split() if w != "\\"]
        if line.startswith("simkv"):
            out.append((line, words))
        elif out and line[0].isspace():
            out[-1] = (out[-1][0], out[-1][1] + words)
    return out


def _command(words: list[str]) -> tuple[click.Command, list[str]]:
    """The click command `simkv A [B]` names (the line's subcommand names separated by `|` each
    count) and the rest of the words."""
    group: click.Command = main
    rest = words[1:]
    while isinstance(group, click.Group):
        name = rest[0].split("|")[0]
        assert name in group.commands, f"simkv has no command {name!r}"
        group, rest = group.commands[name], rest[1:]
    return group, rest


def _names(words: list[str]) -> list[str]:
    """Option names among the words: `--flag`, `-tp`, `--a|--b` alternatives, `--flag=value`."""
    names = []
    for word in words:
        for part in word.split("|"):
            part = part.split("=", 1)[0]
            if _FLAG.match(part):
                names.append(part)
    return names


def test_every_tour_line_names_a_command_and_its_options():
    commands = _commands()
    assert len(commands) > 50  # (the tour is read: a change to its layout would fail here)
    checked = 0
    for line, words in commands:
        # `simkv replay|goodput|capacity|sweep ...`: every command named must take the options
        names = words[1].split("|") if "|" in words[1] else [words[1]]
        for name in names:
            command, rest = _command([words[0], name] + words[2:])
            known = {opt for param in command.params for opt in param.opts + param.secondary_opts}
            for flag in _names(rest):
                assert flag in known, f"README tour: `simkv {name}` has no option {flag} ({line.strip()})"
                checked += 1
    assert checked > 150


DOCS = [README, README.parent / "traces" / "README.md", *sorted((README.parent / "docs").glob("*.md")),
        *sorted((README.parent / "reports").rglob("*.md"))]


def _doc_commands(text: str) -> list[str]:
    """`simkv ...` commands in a page's code spans and code blocks, `&&` chains split."""
    spans = re.findall(r"`((?:\.venv/bin/)?simkv [^`]+)`", text)
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        spans += [line for line in block.splitlines() if re.match(r"\s*(\.venv/bin/)?simkv ", line)]
    out = []
    for span in spans:
        for part in span.split("#", 1)[0].split("&&"):
            part = part.strip().replace(".venv/bin/simkv", "simkv")
            if part.startswith("simkv "):
                out.append(part)
    return out


def test_every_documented_command_names_options_simkv_has():
    """The same check over every `simkv ...` command the docs, the traces' README and the
    reports show (a group named alone, `simkv trace`, is a reference, not a command)."""
    checked = 0
    for page in DOCS:
        for code in _doc_commands(page.read_text()):
            words = [w.strip("[]|(),;") for w in re.sub(r"\"[^\"]*\"|'[^']*'", "Q", code).split() if w != "\\"]
            if len(words) == 2 and isinstance(main.commands.get(words[1]), click.Group):
                continue
            for name in words[1].split("|"):
                command, rest = _command([words[0], name] + words[2:])
                known = {opt for param in command.params for opt in param.opts + param.secondary_opts}
                for flag in _names(rest):
                    assert flag in known, f"{page.name}: `simkv {name}` has no option {flag} ({code[:120]})"
                    checked += 1
    assert checked > 400
