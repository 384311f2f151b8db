"""`simkv replay|goodput|capacity --help` list their options under headings (simkv/cli/help_sections.py):
every engine option has a heading of its own kind, and the help still lists every option once."""

import re

import pytest
from click.testing import CliRunner

from simkv.cli.help_sections import SECTIONS, section_of
from simkv.cli.main import main
from simkv.cli.replay_cmd import _ENGINE_FLAGS


def test_every_engine_option_has_a_heading():
    """An engine option (vLLM's name) added without a heading would fall under "General"."""
    general = SECTIONS[0][0]
    for command in ("replay", "goodput", "capacity"):
        for param in main.commands[command].params:
            if param.name in _ENGINE_FLAGS:
                assert section_of(param.name) != general, f"simkv {command}: --{param.name} has no heading"


@pytest.mark.parametrize("command", ["replay", "goodput", "capacity"])
def test_the_help_lists_every_option_once_under_its_heading(command):
    text = CliRunner().invoke(main, [command, "--help"], terminal_width=200).output
    assert "Options:" not in text
    # the help's sections: heading -> its lines
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        elif current is not None:
            current.append(line)
    titles = [title for title, _ in SECTIONS]
    assert list(sections) == [title for title in titles if title in sections] and list(sections)[0] == "General"
    for param in main.commands[command].params:
        if not param.opts[0].startswith("-") or getattr(param, "hidden", False):
            continue  # (an argument, or a hidden option)
        shown = [title for title, lines in sections.items()
                 if any(re.match(rf"  (-\w+, )?{re.escape(param.opts[0])}([ ,/]|$)", line) for line in lines)]
        assert shown == [section_of(param.name)], (param.opts[0], shown)
