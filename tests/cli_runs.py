"""Running simkv's CLI in tests: a command that must succeed, and one that must fail."""
from __future__ import annotations

from click.testing import CliRunner

from simkv.cli.main import main


def cli_ok(args: list[str]) -> str:
    """Run `simkv ARGS`; assert it succeeded; its output."""
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def cli_fails(args: list[str]) -> str:
    """Run `simkv ARGS`; assert it failed (a clean error, not a crash); its output."""
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.output
