"""The ``simkv trace`` click group end to end."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from simkv.cli.trace_cmd import trace
from simkv.traces import read_trace


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(trace, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def test_synth_inspect_transform(tmp_path: Path) -> None:
    req400 = tmp_path / "req400.parquet"
    code, _ = run("synth", "lognormal", "--out", str(req400))
    assert code == 0
    code, output = run("inspect", str(req400), "--json")
    stats = json.loads(output)
    assert code == 0 and stats["total_tokens"] == 276_007 and stats["longest_request_tokens"] == 2_219
    timed = tmp_path / "timed.csv"
    assert run("transform", str(req400), "--out", str(timed), "--rate", "10", "--head", "50")[0] == 0
    assert len(read_trace(timed)) == 50 and read_trace(timed).arrival_time_s[-1] > 0
    rollouts = tmp_path / "rollouts.parquet"
    code, output = run("transform", str(req400), "--out", str(rollouts), "--head", "20", "--samples", "8")
    assert code == 0 and read_trace(rollouts).n.tolist() == [8] * 20


def test_shared_prefix_reachable_from_cli(tmp_path: Path) -> None:
    out = tmp_path / "groups.parquet"
    code, _ = run("synth", "shared-prefix", "--groups", "10", "--prefix-tokens", "1000", "--base", "lognormal",
                  "--out", str(out))
    assert code == 0
    result = read_trace(out)
    assert len(result.block_hashes(0)) == 125 and result.hash_block_tokens[0] == 8
    code, output = run("inspect", str(out), "--block-size", "16")
    assert "24,180 of" in output and "10 distinct first blocks" in output


def test_multi_turn_and_gamma_from_cli(tmp_path: Path) -> None:
    out = tmp_path / "chat.parquet"
    code, _ = run("synth", "multi-turn", "--sessions", "5", "--turns", "3", "--arrival", "gamma", "--rate", "1",
                  "--cv", "2", "--seed", "4", "--out", str(out))
    assert code == 0 and len(read_trace(out)) == 15


def test_import_csv_reports_drops(tmp_path: Path) -> None:
    source = tmp_path / "b.csv"
    source.write_text("Timestamp,Request tokens,Response tokens\n0,10,0\n1,20,5\n")
    out = tmp_path / "b.parquet"
    code, output = run("import", "csv", str(source), "--out", str(out), "--time-col", "Timestamp",
                       "--prompt-col", "Request tokens", "--output-col", "Response tokens")
    assert code == 0 and "1 with zero output tokens" in output and len(read_trace(out)) == 1


def test_import_burstgpt_selects_and_reports(tmp_path: Path) -> None:
    from tests.traces.test_importers import BURSTGPT_V2

    source = tmp_path / "BurstGPT_3.csv"
    source.write_text(BURSTGPT_V2)
    out = tmp_path / "gpt4.parquet"
    code, output = run("import", "burstgpt", str(source), "--out", str(out), "--model-name", "GPT-4",
                       "--log-type", "conversation")
    assert code == 0 and "kept 2" in output and "3 with another model" in output and "1 conversation;" in output
    assert read_trace(out).request_class.tolist() == ["GPT-4", "GPT-4"]
    code, output = run("import", "azure", str(source), "--out", str(tmp_path / "x.parquet"), "--log-type", "api")
    assert code != 0 and "select rows of a burstgpt import" in output and not (tmp_path / "x.parquet").exists()


def test_a_csv_with_conversations_gets_their_history(tmp_path: Path) -> None:
    source = tmp_path / "conv.csv"
    source.write_text("t,conv,in,out\n0,a,500,100\n2,b,300,50\n9,a,700,80\n12,,900,60\n20,b,200,40\n")
    out = tmp_path / "conv.parquet"
    code, _ = run("import", "csv", str(source), "--out", str(out), "--time-col", "t", "--prompt-col", "in",
                  "--output-col", "out", "--session-col", "conv")
    assert code == 0 and read_trace(out).session_id.tolist() == ["a", "b", "a", None, "b"]
    assert "`simkv trace transform --session-history` infers the turns' history" in run("inspect", str(out))[1]
    code, output = run("transform", str(out), "--session-history", "--out", str(tmp_path / "h.parquet"))
    assert code == 0 and "1 of 2 later turns hold their session's previous prompt and reply, 0 more" in output
    code, output = run("inspect", str(tmp_path / "h.parquet"))
    # a's second turn repeats the first's prompt and reply, 600 tokens: 37 of the 165 blocks
    assert "prefix reuse   0.2242 at 16-token blocks (37 of 165 blocks)" in output
    code, output = run("transform", str(out), "--session-history", "--link-replies", "--out",
                       str(tmp_path / "x.parquet"))
    assert code != 0 and "drop --link-replies" in output
    code, output = run("import", "azure", str(source), "--out", str(tmp_path / "y.parquet"), "--session-col", "c")
    assert code != 0 and "--session-col names a column of a csv import" in output


def test_a_system_prompt_what_if_on_the_azure_slice(tmp_path: Path) -> None:
    out = tmp_path / "sp.parquet"
    code, output = run("transform", "traces/azure_conv_slice.parquet", "--system-prompt-tokens", "1000",
                       "--out", str(out))
    assert code == 0 and "1,187 of 2,000 prompts start with the 1,000-token system prompt" in output
    trace = read_trace(out)
    long_rows = [i for i in range(len(trace)) if trace.prompt_tokens[i] >= 1000]
    assert len({tuple(trace.block_hashes(i)[:62].tolist()) for i in long_rows}) == 1  # (1000 // 16 chunks)


def test_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"timestamp": 0, "input_length": 5, "output_length": 1}\n\xff\xfe\n')
    cases = [
        ("inspect", str(tmp_path / "missing.parquet")),
        ("import", "mooncake", str(bad), "--out", str(tmp_path / "o.parquet")),
        ("import", "csv", str(bad), "--out", str(tmp_path / "o.parquet")),
        ("synth", "lognormal", "--arrival", "poisson", "--out", str(tmp_path / "p.parquet")),
        ("synth", "lognormal", "--out", str(tmp_path / "nofolder" / "p.parquet")),
        ("transform", str(bad), "--out", str(tmp_path / "t.parquet")),
    ]
    for args in cases:
        code, output = run(*args)
        assert code != 0 and output.startswith("Error: ") and "Traceback" not in output, (args, output)
        assert len(output.strip().splitlines()) == 1, output
    assert not (tmp_path / "o.parquet").exists() and not (tmp_path / "p.parquet").exists()
