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
