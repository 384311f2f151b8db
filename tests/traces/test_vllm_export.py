"""`simkv trace export`: vLLM's timed-trace JSON Lines and the simkv trace the server will see.

vLLM's own client building prompts from these files is checked by scripts/vllm_bench_roundtrip.py
(every request's length and shared blocks equal on the bundled traces; docs/validate_vllm.md)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.cli_runs import cli_fails, cli_ok
from simkv.traces.errors import TraceError
from simkv.traces.schema import read_trace, trace_from_frame
from simkv.traces.vllm_bench import export_timed_trace



def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("trace,block_size,extra", [
    ("traces/req400_prefix10.parquet", 32, []),
    ("traces/mooncake_synthetic_slice.parquet", 16, ["--model", "qwen2.5-7b", "--max-model-len", "40000"]),
])
def test_served_trace_replays_like_the_original(tmp_path, trace, block_size, extra):
    """Without replies, salts or sessions the export changes no content: the served trace's
    replay (g-token ids for the trace's H-token blocks) is the original's, request for request."""
    cli_ok(["trace", "export", trace, "--out", str(tmp_path / "t.jsonl"), "--block-size", str(block_size)])
    opts = ["--block-size", str(block_size), "--num-gpu-blocks", "3000", "--quiet", *extra]
    cli_ok(["replay", trace, *opts, "--out", str(tmp_path / "a")])
    cli_ok(["replay", str(tmp_path / "t.parquet"), *opts, "--out", str(tmp_path / "b")])
    a, b = pd.read_parquet(tmp_path / "a" / "requests.parquet"), pd.read_parquet(tmp_path / "b" / "requests.parquet")
    assert a.equals(b)
    assert a["prefix_hit_tokens"].sum() > 10_000 and a["num_preemptions"].sum() > 0  # (the check has teeth)


def test_lines_cover_every_prompt_token_in_arrival_order(tmp_path):
    out = cli_ok(["trace", "export", "traces/mooncake_synthetic_slice.parquet", "--out", str(tmp_path / "m.jsonl"),
                "--block-size", "64"])
    assert "(64-token chunks)" in out and "--timed-trace-chunk-hash-size 64 --num-prompts 1000" in out
    lines, trace = _lines(tmp_path / "m.jsonl"), read_trace("traces/mooncake_synthetic_slice.parquet")
    assert [x["request_id"] for x in lines] == list(trace.request_id)
    assert [x["timestamp"] for x in lines] == trace.arrival_time_s.tolist()
    assert [x["input_length"] for x in lines] == trace.prompt_tokens.tolist()
    assert [x["output_length"] for x in lines] == trace.output_tokens.tolist()
    # vLLM's client builds a prompt from its ids only: each needs ceil(P / 64) of them
    assert all(len(x["hash_ids"]) == -(-x["input_length"] // 64) for x in lines)
    # 512-token hash blocks became 8 ids each: two prompts sharing their first hash block share 8 ids
    first = {}
    for i in range(len(trace)):
        first.setdefault(int(trace.block_hashes(i)[0]), []).append(i)
    shared = next(rows for rows in first.values() if len(rows) > 1 and min(trace.prompt_tokens[rows]) >= 1024)
    a, b = (lines[r]["hash_ids"] for r in shared[:2])
    assert a[:8] == b[:8] and len(set(a[:8])) == 8


def test_unique_content_gets_unused_ids_and_salts_separate():
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0, 2.0, 3.0], "prompt_tokens": [40, 40, 40, 20],
                          "output_tokens": [5, 5, 5, 5], "block_hashes": [[7, 8], [7, 8], [7, 8], []],
                          "hash_block_tokens": 16, "cache_salt": [None, None, "tenant-b", None]})
    export = export_timed_trace(trace_from_frame(frame), block_size=16)
    ids = [json.loads(line)["hash_ids"] for line in export.lines]
    assert ids[0] == [0, 1, 2] and ids[1] == [0, 1, 3]  # shared blocks, then each prompt's own last chunk
    assert not set(ids[2]) & set(ids[0])  # another tenant's salt: nothing shared
    assert ids[3] == [7, 8] and any("salts" in n for n in export.notes)  # a row without hashes: fresh ids


def test_replies_sessions_and_priorities_are_left_out(tmp_path):
    out = cli_ok(["trace", "export", "traces/kvcache_coding_sessions.parquet", "--out", str(tmp_path / "s.jsonl")])
    assert "89 rows describe their replies" in out and "not paced" in out
    served = read_trace(tmp_path / "s.parquet")
    assert served.session_id is None and served.cache_salt is None and served.priority is None
    assert all(len(served.block_hashes(i)) == -(-served.prompt_tokens[i] // 16) for i in range(len(served)))


def test_export_is_deterministic_and_refuses_parallel_sampling(tmp_path):
    for name in ("a", "b"):
        cli_ok(["trace", "export", "traces/req400_prefix10.parquet", "--out", str(tmp_path / f"{name}.jsonl")])
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [10, 10], "output_tokens": [3, 3], "n": [1, 4]})
    with pytest.raises(TraceError, match=r"column 'n', row 1: n = 4"):
        export_timed_trace(trace_from_frame(frame, source="p.parquet"))
    out = cli_fails(["trace", "export", "traces/req400.parquet", "--out", str(tmp_path / "x.txt")])
    assert "name it *.jsonl" in out and not (tmp_path / "x.txt").exists()
    assert not (tmp_path / "x.parquet").exists()


def test_chunk_size_divides_block_size_and_hash_blocks():
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [100, 100], "output_tokens": [3, 3],
                          "block_hashes": [[1, 2, 3, 4], [1, 2, 3, 4]], "hash_block_tokens": [24, 24]})
    export = export_timed_trace(trace_from_frame(frame), block_size=16)
    assert export.chunk_tokens == 8  # gcd(24, 16)
    ids = [json.loads(line)["hash_ids"] for line in export.lines]
    assert len(ids[0]) == 13 and ids[0][:12] == ids[1][:12]  # 96 tokens described by the 4 hash ids
    assert ids[0][12] != ids[1][12]  # positions 96-99 are past the lists: each request's own
    assert np.all(export.served.hash_block_tokens == 8)


def test_adapters_separate_ids_and_are_noted():
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0, 2.0], "prompt_tokens": [32, 32, 32], "output_tokens": [2, 2, 2],
                          "block_hashes": [[5, 6]] * 3, "hash_block_tokens": 16, "lora_name": ["a", "b", "a"]})
    export = export_timed_trace(trace_from_frame(frame), block_size=16)
    ids = [json.loads(line)["hash_ids"] for line in export.lines]
    assert ids[0] == ids[2] and not set(ids[0]) & set(ids[1])
    assert any("LoRA adapters are folded into the hash ids" in n for n in export.notes)
    assert export.served.lora_name is None
