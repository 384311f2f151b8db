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


def _words(code: str) -> list[str]:
    """A command's words, quoted strings (another tool's command line) as one placeholder, the
    brackets and bars of optional parts stripped."""
    return [w.strip("[]|(),;") for w in re.sub(r"\"[^\"]*\"|'[^']*'", "Q", code).split() if w != "\\"]


def _commands() -> list[tuple[str, list[str]]]:
    """(the line, its words) for each tour command, continuation lines joined to theirs;
    comments and quoted strings (another tool's command line) dropped."""
    out: list[tuple[str, list[str]]] = []
    for line in _tour():
        code = line.split("#", 1)[0]
        words = _words(code)
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


def _check(words: list[str], where: str) -> int:
    """Assert that `simkv A[|B] ...` names commands that take every option among the words (a
    line may name several commands, `simkv replay|goodput ...`); the options checked."""
    checked = 0
    for name in words[1].split("|"):
        command, rest = _command([words[0], name] + words[2:])
        known = {opt for param in command.params for opt in param.opts + param.secondary_opts} | {"--help"}
        for flag in _names(rest):
            assert flag in known, f"{where}: `simkv {name}` has no option {flag}"
            checked += 1
    return checked


def test_every_tour_line_names_a_command_and_its_options():
    commands = _commands()
    assert len(commands) > 50  # (the tour is read: a change to its layout would fail here)
    assert sum(_check(words, f"README tour ({line.strip()})") for line, words in commands) > 150


DOCS = [README, README.parent / "traces" / "README.md", *sorted((README.parent / "docs").glob("*.md")),
        *sorted((README.parent / "reports").rglob("*.md"))]


def _doc_commands(text: str) -> list[str]:
    """`simkv ...` commands in a page's code spans and code blocks, fenced or indented (lines
    ending in a backslash joined), `&&` chains split."""
    text = text.replace("\\\n", " ")  # (a command continued on the next line)
    spans = re.findall(r"`((?:\.venv/bin/)?simkv [^`]+)`", text)
    # indented code blocks (a list item's indented prose may start with "simkv" too: a command's
    # name must follow)
    spans += [line for line in re.findall(r"^ {4,}((?:\.venv/bin/)?simkv .*)$", text, re.M)
              if line.split()[1].split("|")[0] in main.commands]
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
            words = _words(code)
            if len(words) > 2 or not isinstance(main.commands.get(words[1]), click.Group):
                checked += _check(words, f"{page.name} ({code[:120]})")
    assert checked > 800
