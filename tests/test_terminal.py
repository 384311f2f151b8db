"""The console simkv prints its tables on (simkv/terminal.py)."""

from __future__ import annotations

from simkv.terminal import PIPE_WIDTH, console


def test_a_pipe_gets_a_wide_console_and_columns_win(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert console().width == PIPE_WIDTH  # (pytest's stdout is no terminal)
    monkeypatch.setenv("COLUMNS", "97")
    assert console().width == 97


def test_a_replay_piped_keeps_every_digit_of_its_replica_table(tmp_path, monkeypatch):
    from tests.cli_runs import cli_ok

    monkeypatch.delenv("COLUMNS", raising=False)
    text = cli_ok(["replay", "traces/req400.parquet", "--replicas", "4", "--out", str(tmp_path / "r")])
    assert "…" not in text and "preemptions" in text
