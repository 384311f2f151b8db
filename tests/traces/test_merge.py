"""`simkv trace merge` (simkv/traces/merge.py), the request_class column and `transform --request-class`."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from simkv.traces import TraceError, trace_from_frame
from simkv.traces.merge import merge_traces
from simkv.traces.reuse import prefix_reuse
from simkv.traces.schema import read_trace, take_rows, write_trace
from simkv.traces.stats import trace_stats
from simkv.traces.transform import Edits, transform
from tests.cli_runs import cli_fails, cli_ok


def chat() -> object:
    """Three turns of one conversation sharing a prefix (hash ids from 0, as Mooncake numbers them)."""
    return trace_from_frame(pd.DataFrame({
        "arrival_time_s": [0.0, 1.0, 3.0], "prompt_tokens": [8, 12, 16], "output_tokens": [2, 2, 2],
        "request_id": ["a", "b", "c"], "block_hashes": [[0, 1], [0, 1, 2], [0, 1, 2, 3]], "hash_block_tokens": 4,
        "session_id": ["s", "s", "s"], "think_time_s": [0.0, 0.5, 0.5]}), source="chat.parquet")


def batch() -> object:
    """Two summaries with their own prefix, numbered from 0 too, a priority and images."""
    return trace_from_frame(pd.DataFrame({
        "arrival_time_s": [1.0, 2.0], "prompt_tokens": [8, 8], "output_tokens": [50, 50],
        "request_id": ["a", "z"], "block_hashes": [[0, 1], [0, 1]], "hash_block_tokens": 4, "priority": [1, 1],
        "mm_offsets": [[0], []], "mm_lengths": [[4], []], "mm_hashes": [[7], []]}), source="batch.parquet")


def test_merge_keeps_times_labels_rows_and_prefixes_their_ids():
    merged = merge_traces([("chat", chat()), ("batch", batch())])
    assert merged.arrival_time_s.tolist() == [0.0, 1.0, 1.0, 2.0, 3.0]  # a tie keeps input order
    assert merged.request_class.tolist() == ["chat", "chat", "batch", "batch", "chat"]
    assert merged.request_id.tolist() == ["chat/a", "chat/b", "batch/a", "batch/z", "chat/c"]
    assert merged.session_id.tolist() == ["chat/s", "chat/s", None, None, "chat/s"]
    # what an input lacked, filled with what its absence means
    assert merged.priority.tolist() == [0, 0, 1, 1, 0]
    assert merged.think_time_s.tolist() == [0.0, 0.5, 0.0, 0.0, 0.5]
    assert [len(merged.multimodal_items(i)) for i in range(5)] == [0, 0, 1, 0, 0]


def test_merged_inputs_share_no_prompt_content_unless_told():
    apart = merge_traces([("chat", chat()), ("batch", batch())])
    shared = merge_traces([("chat", chat()), ("batch", batch())], shared_content=True)
    ids = [set(apart.block_hashes(i).tolist()) for i in range(5)]
    assert not (ids[0] | ids[1] | ids[4]) & (ids[2] | ids[3])  # both numbered their blocks from 0
    assert ids[2] == ids[3] and ids[0] < ids[1] < ids[4]  # within an input, equal stays equal
    # reuse within each input is what it was; shared content adds batch's hits on chat's blocks
    alone = prefix_reuse(chat(), 4).reused_blocks + prefix_reuse(batch(), 4).reused_blocks
    assert prefix_reuse(apart, 4).reused_blocks == alone
    assert prefix_reuse(shared, 4).reused_blocks == alone + 2
    assert apart.multimodal_items(2)[0][2] != 7 and shared.multimodal_items(2)[0][2] == 7


def test_merge_is_deterministic_and_round_trips(tmp_path):
    for name in ("m.parquet", "m.csv"):
        a, b = tmp_path / f"1{name}", tmp_path / f"2{name}"
        write_trace(merge_traces([("chat", chat()), ("batch", batch())]), a)
        write_trace(merge_traces([("chat", chat()), ("batch", batch())]), b)
        assert a.read_bytes() == b.read_bytes()
        back = read_trace(a)
        assert back.request_class.tolist() == ["chat", "chat", "batch", "batch", "chat"]
    # a labelled trace merged again keeps its labels; the same label twice prefixes ids by position
    labelled = merge_traces([("chat", chat()), ("batch", batch())])
    again = merge_traces([(None, labelled), ("chat", chat())])
    assert again.request_class.tolist().count("chat") == 6
    assert again.request_id.tolist()[:2] == ["0/chat/a", "1/a"]


def test_merge_refuses_what_it_cannot_label():
    with pytest.raises(TraceError, match="at least two"):
        merge_traces([("chat", chat())])
    with pytest.raises(TraceError, match="chat.parquet: no request_class column; name its class"):
        merge_traces([(None, chat()), ("batch", batch())])
    with pytest.raises(TraceError, match="empty class label"):
        merge_traces([(" ", chat()), ("batch", batch())])


def test_request_class_column_is_checked():
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [4, 4], "output_tokens": [1, 1],
                          "request_class": ["chat", ""]})
    with pytest.raises(TraceError, match="request_class.*row 1.*empty label"):
        trace_from_frame(frame)
    frame["request_class"] = ["chat", None]
    with pytest.raises(TraceError, match="request_class.*row 1.*missing value"):
        trace_from_frame(frame)
    frame["request_class"] = ["chat", "batch"]
    trace = trace_from_frame(frame)
    assert take_rows(trace, np.array([1])).request_class.tolist() == ["batch"]
    stats = trace_stats(trace)
    assert stats.request_classes == {"chat": 1, "batch": 1}
    assert stats.class_stats["batch"]["rows"] == 1 and stats.class_stats["chat"]["mean_rate_per_s"] == 1.0


def test_transform_labels_every_request():
    out = transform(chat(), Edits(head=2, request_class="interactive"))
    assert out.request_class.tolist() == ["interactive", "interactive"]
    with pytest.raises(TraceError, match="--request-class"):
        transform(chat(), Edits(request_class=""))


def test_merge_command(tmp_path):
    write_trace(chat(), tmp_path / "chat.parquet")
    write_trace(batch(), tmp_path / "b.parquet")
    out = tmp_path / "mix.parquet"
    text = cli_ok(["trace", "merge", str(tmp_path / "chat.parquet"), f"summaries={tmp_path / 'b.parquet'}",
                   "--out", str(out)])
    assert "wrote 5 requests" in text and "chat 3, summaries 2" in text  # a bare path: its file name
    shown = cli_ok(["trace", "inspect", str(out)])
    assert "classes        2: chat 3, summaries 2" in shown and "  summaries    0.67 req/s; prompt p50 8" in shown
    assert "no such file" in cli_fails(["trace", "merge", "x=nope.parquet", f"y={out}", "--out", str(out)])
    assert read_trace(out).request_class.tolist() == ["chat", "chat", "summaries", "summaries", "chat"]
    cli_ok(["trace", "transform", str(out), "--request-class", "all", "--out", str(tmp_path / "t.parquet")])
    assert set(read_trace(tmp_path / "t.parquet").request_class) == {"all"}


def test_time_offset_moves_every_arrival_and_keeps_them_non_negative():
    out = transform(chat(), Edits(time_offset=2.5))
    assert out.arrival_time_s.tolist() == [2.5, 3.5, 5.5] and out.think_time_s.tolist() == [0.0, 0.5, 0.5]
    assert transform(out, Edits(time_offset=-2.5)).arrival_time_s.tolist() == [0.0, 1.0, 3.0]
    with pytest.raises(TraceError, match="--time-offset -1 moves the first arrival"):
        transform(chat(), Edits(time_offset=-1.0))
