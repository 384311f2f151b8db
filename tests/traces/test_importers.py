"""Importers against the real shared traces (README figures) and against small hand-made files."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from simkv.traces import TraceError, read_trace, write_trace
from simkv.traces.importers import ColumnMap, ConversationStarts, import_to_file, import_trace
from simkv.traces.stats import trace_stats


def test_azure_conv_matches_readme(shared_traces: Path, tmp_path: Path) -> None:
    out = tmp_path / "conv.parquet"
    report = import_to_file("azure", [shared_traces / "azure/AzureLLMInferenceTrace_conv.csv"], out)
    stats = trace_stats(read_trace(out))
    assert stats.rows == report.rows_kept == 19_366 and not report.dropped
    assert [round(v) for v in (stats.prompt.p50, stats.prompt.p90, stats.prompt.p99)] == [1020, 2734, 4142]
    assert stats.prompt.max == 14_050
    assert [round(v) for v in (stats.output.p50, stats.output.p90, stats.output.p99)] == [129, 424, 601]
    assert round(stats.mean_rate_per_s, 1) == 5.5


def test_azure_code_matches_readme(shared_traces: Path) -> None:
    trace, _ = import_trace("azure", [shared_traces / "azure/AzureLLMInferenceTrace_code.csv"])
    stats = trace_stats(trace)
    assert stats.rows == 8_819 and stats.peak_per_min == 632
    assert [round(v) for v in (stats.prompt.p50, stats.prompt.p90, stats.prompt.p99)] == [1469, 5188, 7436]
    assert stats.prompt.max == 7_437 and stats.output.max == 1_899


def test_azure_arrivals_are_exact_offsets_from_the_first_row(shared_traces: Path) -> None:
    trace, _ = import_trace("azure", [shared_traces / "azure/AzureLLMInferenceTrace_conv.csv"])
    # 18:15:46.6805900 -> 18:15:50.9951690 and the last row 19:14:08.4025270
    assert trace.arrival_time_s[0] == 0.0 and trace.arrival_time_s[1] == 4.314579
    assert trace.arrival_time_s[-1] == 3501.721937


def test_mooncake_matches_readme_and_is_fast(shared_traces: Path, tmp_path: Path) -> None:
    out = tmp_path / "mc.parquet"
    started = time.perf_counter()
    import_to_file("mooncake", [shared_traces / "mooncake/synthetic_trace.jsonl"], out)
    assert time.perf_counter() - started < 2.0
    trace = read_trace(out)
    stats = trace_stats(trace, block_size=512)
    assert stats.rows == 3_993 and round(stats.prompt.p50) == 11_587 and stats.prompt.max == 191_378
    assert round(stats.reuse_ratio, 2) == 0.64 and stats.distinct_first_blocks == 2_211
    assert all(len(trace.block_hashes(i)) == -(-trace.prompt_tokens[i] // 512) for i in range(len(trace)))


def test_kvcache_tester_namespaces_conversations(shared_traces: Path) -> None:
    trace, report = import_trace("kvcache-tester", [shared_traces / "kvcache_tester"],
                                 starts=ConversationStarts(gap_s=1000.0))
    assert len(trace) == report.rows_kept == 115
    owners: dict[int, str] = {}
    for i in range(len(trace)):
        conversation = trace.request_id[i].split("/")[0]
        for h in trace.block_hashes(i).tolist():
            assert owners.setdefault(h, conversation) == conversation
    assert len(set(owners.values())) == 12
    assert set(trace.hash_block_tokens.tolist()) == {64}
    first = {rid: t for rid, t in zip(trace.request_id, trace.arrival_time_s)}
    assert first["trace_0026/0"] == 0.0 and first["trace_0026/1"] == 94.0 and first["trace_0058/0"] == 1000.0
    assert round(trace_stats(trace, 64).reuse_ratio, 2) > 0.8


def conversation(requests: list) -> dict:
    return {"id": "c", "block_size": 4, "hash_id_scope": "local", "requests": requests}


def test_kvcache_tester_subagents_and_poisson_starts(tmp_path: Path) -> None:
    sub = {"type": "subagent", "agent_id": "a1", "requests": [{"t": 5, "in": 8, "out": 2, "hash_ids": [1, 9]}]}
    body = conversation([{"t": 0, "in": 8, "out": 3, "hash_ids": [1, 2]}, sub, {"t": 9, "in": 9, "out": 0}])
    for name in ("x.json", "y.json"):
        (tmp_path / name).write_text(json.dumps(body))
    trace, report = import_trace("kvcache-tester", [tmp_path], starts=ConversationStarts(rate=0.01, seed=3))
    assert report.dropped == {"zero output tokens": 2} and len(trace) == 4
    ids = list(trace.request_id)
    assert "x/a1/0" in ids and "y/0" in ids
    x0, y0 = trace.block_hashes(ids.index("x/0")), trace.block_hashes(ids.index("y/0"))
    assert x0.tolist() == [0, 1] and y0.tolist() == [9, 10]  # 'y' shifted past x's id range 1..9
    assert trace.block_hashes(ids.index("x/a1/0")).tolist() == [0, 8]
    offsets = trace.arrival_time_s[ids.index("y/a1/0")] - trace.arrival_time_s[ids.index("y/0")]
    assert offsets == 5.0


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"t": 0, "in": "x", "out": 1}, "requests[0]: field 'in'"),
        ({"t": -1, "in": 5, "out": 1}, "requests[0]: field 't'"),
        ({"in": 5, "out": 1}, "requests[0]: field 't' is missing"),
        ({"t": 0, "in": 4, "out": 1, "hash_ids": [1, 2]}, "requests[0]: field 'hash_ids'"),
        ({"t": 0, "in": 4, "out": 1, "hash_ids": ["a"]}, "requests[0]: field 'hash_ids'"),
    ],
)
def test_kvcache_tester_errors_name_file_request_and_field(tmp_path: Path, entry: dict, expected: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(conversation([entry])))
    with pytest.raises(TraceError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        import_trace("kvcache-tester", [path])


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (['{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}', '{"timestamp": 5'],
         "line 2: not a JSON object"),
        (['{"timestamp": 0, "input_length": -3, "output_length": 1}'], "line 1: field 'input_length'"),
        (['{"timestamp": "x", "input_length": 3, "output_length": 1}'], "line 1: field 'timestamp'"),
        (['{"input_length": 3, "output_length": 1}'], "line 1: field 'timestamp' is missing"),
        (['{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1, 2]}'], "line 1: field 'hash_ids'"),
        (['[1, 2]'], "line 1: not a JSON object"),
    ],
)
def test_mooncake_errors_name_line_and_field(tmp_path: Path, lines: list[str], expected: str) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=expected.replace("[", r"\[")):
        import_trace("mooncake", [path])
    assert not (tmp_path / "out.parquet").exists()


def test_mooncake_drops_zero_lengths_and_bad_output_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    good = '{"timestamp": 1500, "input_length": 600, "output_length": 2, "hash_ids": [4, 5]}'
    path.write_text(good + '\n{"timestamp": 2000, "input_length": 6, "output_length": 0, "hash_ids": [4]}\n\n')
    trace, report = import_trace("mooncake", [path])
    assert report.dropped == {"zero output tokens": 1} and trace.arrival_time_s.tolist() == [1.5]
    path.write_text(good + "\n" + good[:-9] + "\n")
    out = tmp_path / "out.parquet"
    with pytest.raises(TraceError):
        import_to_file("mooncake", [path], out)
    assert list(tmp_path.iterdir()) == [path]


def burstgpt_like(tmp_path: Path) -> Path:
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5.0,ChatGPT,472,18,490,Conversation log\n"
        "7.5,GPT-4,1087,0,1087,Conversation log\n"
        "6.0,ChatGPT,300,40,340,API log\n"
    )
    return path


def test_csv_mapping_drops_zero_output_and_keeps_order(tmp_path: Path) -> None:
    mapping = ColumnMap(time="Timestamp", prompt="Request tokens", output="Response tokens")
    out = tmp_path / "b.parquet"
    report = import_to_file("csv", [burstgpt_like(tmp_path)], out, mapping=mapping)
    assert report.rows_read == 3 and report.rows_kept == 2 and report.dropped == {"zero output tokens": 1}
    trace = read_trace(out)
    assert trace.arrival_time_s.tolist() == [0.0, 1.0] and trace.prompt_tokens.tolist() == [472, 300]
    again, _ = import_trace("csv", [burstgpt_like(tmp_path)], mapping=mapping)
    assert again == trace


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ("8.0,x,abc,3,0,y", "column 'Request tokens', row 3: not a number: 'abc'"),
        ("8.0,x,-4,3,0,y", "column 'Request tokens', row 3: value -4 is below 0"),
        ("8.0,x,4,,0,y", "column 'Response tokens', row 3: missing value"),
        ("1.0,x,4,3,0,y", "column 'Timestamp', row 3: time is before the first row"),
        ("8.0,x,4", "line 5: expected 6 fields, got 3"),
    ],
)
def test_csv_errors_name_row_and_column(tmp_path: Path, row: str, expected: str) -> None:
    path = burstgpt_like(tmp_path)
    path.write_text(path.read_text() + row + "\n")
    mapping = ColumnMap(time="Timestamp", prompt="Request tokens", output="Response tokens")
    with pytest.raises(TraceError, match=expected):
        import_to_file("csv", [path], tmp_path / "o.parquet", mapping=mapping)
    assert not (tmp_path / "o.parquet").exists()


def test_csv_missing_column_and_parquet_source(tmp_path: Path) -> None:
    mapping = ColumnMap(time="Timestamp", prompt="Prompt", output="Response tokens")
    with pytest.raises(TraceError, match="Prompt"):
        import_trace("csv", [burstgpt_like(tmp_path)], mapping=mapping)
    trace, _ = import_trace("csv", [burstgpt_like(tmp_path)],
                            mapping=ColumnMap("Timestamp", "Request tokens", "Response tokens"))
    write_trace(trace, tmp_path / "canon.parquet")
    back, _ = import_trace("csv", [tmp_path / "canon.parquet"],
                           mapping=ColumnMap("arrival_time_s", "prompt_tokens", "output_tokens", "request_id"))
    assert back == trace


BURSTGPT_V2 = (  # (the newer releases' columns: sessions and each request's elapsed time)
    "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,,1.2,ChatGPT,472,18,490,API log\n"
    "45,s-1,3.5,ChatGPT,1020,120,1140,Conversation log\n"
    "47,,,GPT-4,300,0,300,API log\n"
    "60,s-1,2.0,ChatGPT,1300,80,1380,Conversation log\n"
    "52,s-2,10.0,GPT-4,900,300,1200,Conversation log\n"
    "58,s-2,4.0,GPT-4,1500,200,1700,Conversation log\n")


def test_burstgpt_keeps_models_sessions_and_the_users_think_times(tmp_path: Path) -> None:
    path = tmp_path / "BurstGPT_3.csv"
    path.write_text(BURSTGPT_V2)
    trace, report = import_trace("burstgpt", [path])
    assert report.rows_read == 6 and report.dropped == {"zero response tokens (failed)": 1}
    # sorted by Timestamp, from the first kept row; the model is each row's class
    assert trace.arrival_time_s.tolist() == [0.0, 40.0, 47.0, 53.0, 55.0]
    assert trace.prompt_tokens.tolist() == [472, 1020, 900, 1500, 1300]
    assert trace.request_class.tolist() == ["ChatGPT", "ChatGPT", "GPT-4", "GPT-4", "ChatGPT"]
    assert trace.session_id.tolist() == [None, "s-1", "s-2", "s-2", "s-1"]
    # s-1's second turn came 11.5 s after its first reply (45 + 3.5); s-2's before its reply ended: 0
    assert trace.think_time_s.tolist() == [0.0, 0.0, 0.0, 0.0, 11.5]
    # the selections, each counted
    chat, report = import_trace("burstgpt", [path], models=("ChatGPT",), log_type="conversation")
    assert chat.prompt_tokens.tolist() == [1020, 1300] and chat.arrival_time_s.tolist() == [0.0, 15.0]
    assert report.dropped == {"zero response tokens (failed)": 1, "another model": 2, "another log type": 1}
    with pytest.raises(TraceError, match="no requests left to import"):
        import_trace("burstgpt", [path], models=("GPT-5",))
    with pytest.raises(TraceError, match="select rows of a burstgpt import"):
        import_trace("csv", [path], models=("GPT-4",), mapping=ColumnMap("Timestamp", "Request tokens",
                                                                          "Response tokens"))
    # the first releases' columns: no sessions, no think times
    old, report = import_trace("burstgpt", [burstgpt_like(tmp_path)])
    assert old.session_id is None and old.think_time_s is None
    assert old.arrival_time_s.tolist() == [0.0, 1.0] and old.request_class.tolist() == ["ChatGPT", "ChatGPT"]
    # a release converted to parquet reads alike
    import pandas as pd

    pd.read_csv(path, dtype={"Session ID": str}).to_parquet(tmp_path / "v2.parquet")
    again, _ = import_trace("burstgpt", [tmp_path / "v2.parquet"])
    assert again == trace
    # bad cells name their row and column
    path.write_text(BURSTGPT_V2 + "61,s-3,soon,GPT-4,10,10,20,API log\n")
    with pytest.raises(TraceError, match="column 'Elapsed time', row 6: not a number: 'soon'"):
        import_trace("burstgpt", [path])
    path.write_text(BURSTGPT_V2.replace("Model,", "Engine,"))
    with pytest.raises(TraceError, match="Model"):
        import_trace("burstgpt", [path])


@pytest.mark.parametrize("fmt", ["mooncake", "azure", "kvcache-tester"])
def test_import_write_read_round_trip(shared_traces: Path, tmp_path: Path, fmt: str) -> None:
    source = {
        "mooncake": shared_traces / "mooncake/synthetic_trace.jsonl",
        "azure": shared_traces / "azure/AzureLLMInferenceTrace_code.csv",
        "kvcache-tester": shared_traces / "kvcache_tester",
    }[fmt]
    imported, _ = import_trace(fmt, [source])
    for name in ("t.parquet", "t.csv.gz"):
        write_trace(imported, tmp_path / name)
        assert read_trace(tmp_path / name) == imported
    import_to_file(fmt, [source], tmp_path / "s.parquet")
    assert read_trace(tmp_path / "s.parquet") == imported
    import_to_file(fmt, [source], tmp_path / "s2.parquet")
    assert (tmp_path / "s.parquet").read_bytes() == (tmp_path / "s2.parquet").read_bytes()
    assert np.all(np.diff(imported.arrival_time_s) >= 0)
