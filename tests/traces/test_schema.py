"""The canonical schema: validation messages, sorting, CSR hashes and round trips."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from simkv.traces import Trace, TraceError, read_trace, trace_from_frame, trace_to_frame, write_trace


def small_frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "arrival_time_s": [1.0, 0.5, 0.5],
            "prompt_tokens": [10, 20, 30],
            "output_tokens": [1, 2, 3],
            "block_hashes": [[1, 2], None, [5]],
            "hash_block_tokens": [8, 8, 16],
            "cache_salt": ["a", None, "b"],
        }
    )


def test_rows_sorted_stably_and_hashes_follow_their_rows() -> None:
    trace = trace_from_frame(small_frame())
    assert trace.arrival_time_s.tolist() == [0.5, 0.5, 1.0]
    assert trace.request_id.tolist() == ["1", "2", "0"]
    assert trace.block_hashes(0).tolist() == []
    assert trace.block_hashes(1).tolist() == [5]
    assert trace.block_hashes(2).tolist() == [1, 2]
    assert trace.hash_block_tokens.tolist() == [0, 16, 8]
    assert trace.cache_salt.tolist() == [None, "b", "a"]
    assert trace.hash_offsets.dtype == np.int64 and len(trace.hash_offsets) == 4


def test_minimal_trace_has_no_optional_columns() -> None:
    trace = trace_from_frame(pd.DataFrame({"arrival_time_s": [0], "prompt_tokens": [5], "output_tokens": [1]}))
    assert trace.hash_ids is None and trace.hash_offsets is None and trace.hash_block_tokens is None
    assert trace.cache_salt is None and trace.priority is None and trace.n is None
    assert trace.request_id.tolist() == ["0"]
    assert trace.block_hashes(0).size == 0
    assert trace.arrival_time_s.dtype == np.float64 and trace.prompt_tokens.dtype == np.int64


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".csv.gz"])
def test_write_read_round_trip(tmp_path: Path, suffix: str) -> None:
    trace = trace_from_frame(small_frame().assign(priority=[3, -1, 0], n=[1, 2, 1]))
    path = tmp_path / f"t{suffix}"
    write_trace(trace, path)
    again = read_trace(path)
    assert again == trace
    assert again.source == str(path)
    assert trace_from_frame(trace_to_frame(trace)) == trace


def test_written_bytes_are_reproducible(tmp_path: Path) -> None:
    trace = trace_from_frame(small_frame())
    for name in ("a.parquet", "b.parquet", "a.csv.gz", "b.csv.gz"):
        write_trace(trace, tmp_path / name)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert (tmp_path / "a.csv.gz").read_bytes() == (tmp_path / "b.csv.gz").read_bytes()


def test_hash_block_tokens_from_parquet_metadata(tmp_path: Path) -> None:
    table = pa.table(
        {"arrival_time_s": [0.0], "prompt_tokens": [40], "output_tokens": [2], "block_hashes": [[7, 8, 9]]}
    ).replace_schema_metadata({"hash_block_tokens": "16"})
    pq.write_table(table, tmp_path / "m.parquet")
    trace = read_trace(tmp_path / "m.parquet")
    assert trace.hash_block_tokens.tolist() == [16]
    assert trace.block_hashes(0).tolist() == [7, 8, 9]


def test_csv_hash_lists_as_text_or_json(tmp_path: Path) -> None:
    path = tmp_path / "h.csv"
    path.write_text(
        "arrival_time_s,prompt_tokens,output_tokens,block_hashes,hash_block_tokens\n"
        '0,20,1,"1 2 3",8\n1,20,1,"[4, 5]",8\n2,20,1,,\n'
    )
    trace = read_trace(path)
    assert [trace.block_hashes(i).tolist() for i in range(3)] == [[1, 2, 3], [4, 5], []]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"prompt_tokens": ["1", "x", "3"]}, "column 'prompt_tokens', row 1: not a number"),
        ({"prompt_tokens": [1.0, 2.5, 3.0]}, "column 'prompt_tokens', row 1: not an integer"),
        ({"output_tokens": [1, 0, 2]}, "column 'output_tokens', row 1: value 0 is below 1"),
        ({"output_tokens": [1.0, None, 2.0]}, "column 'output_tokens', row 1: missing value"),
        ({"arrival_time_s": [0.0, -1.0, 2.0]}, "column 'arrival_time_s', row 1: negative"),
        ({"arrival_time_s": [0.0, 1.0, np.inf]}, "column 'arrival_time_s', row 2: not a finite"),
        ({"block_hashes": [[1, 2, 3], None, None]}, "column 'block_hashes', row 0: 3 hash ids"),
        ({"hash_block_tokens": [8, 8, 0]}, "column 'hash_block_tokens', row 2"),
        ({"n": [1, 0, 1]}, "column 'n', row 1"),
        ({"request_id": ["a", "b", "a"]}, "column 'request_id', row 2: duplicate"),
        ({"prompt_tokens": [True, False, True]}, "column 'prompt_tokens', row 0: wrong type"),
        ({"prompt_tokens": [10, 2**50, 5]}, "column 'prompt_tokens', row 1: value"),
    ],
)
def test_bad_cells_name_column_and_first_row(change: dict, expected: str) -> None:
    frame = small_frame()
    for name, values in change.items():
        frame[name] = values
    with pytest.raises(TraceError) as info:
        trace_from_frame(frame, source="f.csv")
    message = str(info.value)
    assert message.startswith("f.csv: ") and expected in message and "\n" not in message


def test_missing_required_column_and_missing_block_size() -> None:
    with pytest.raises(TraceError, match="missing required column 'output_tokens'"):
        trace_from_frame(pd.DataFrame({"arrival_time_s": [0.0], "prompt_tokens": [3]}))
    frame = pd.DataFrame({"arrival_time_s": [0.0], "prompt_tokens": [3], "output_tokens": [1], "block_hashes": [[1]]})
    with pytest.raises(TraceError, match="column 'hash_block_tokens', row 0"):
        trace_from_frame(frame)
    assert trace_from_frame(frame, hash_block_tokens=4).hash_block_tokens.tolist() == [4]


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("e.csv", b"", "empty file"),
        ("e.parquet", b"", "empty file"),
        ("bad.parquet", b"PAR1 not really", "not a readable parquet file"),
        ("t.json", b"{}", "unknown trace file type"),
        ("h.csv", b"arrival_time_s,prompt_tokens,output_tokens\n", "no rows"),
        ("u.csv", b"arrival_time_s,prompt_tokens,output_tokens\n0,1,1\n1,\xff\xfe,2\n", "line 3: bytes that are not UTF-8"),
        ("w.csv", b"arrival_time_s,prompt_tokens,output_tokens\n0,1,1\n1,2\n", "line 3: expected 3 fields, got 2"),
    ],
)
def test_bad_files_give_one_line_errors(tmp_path: Path, name: str, content: bytes, expected: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert str(info.value).startswith(str(path)) and expected in str(info.value)


def test_type_error_late_in_a_large_csv_names_its_row(tmp_path: Path) -> None:
    rows = ["arrival_time_s,prompt_tokens,output_tokens"] + [f"{i},{i + 1},1" for i in range(200_000)]
    rows[150_001] = "150000,oops,1"
    path = tmp_path / "late.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(TraceError, match="column 'prompt_tokens', row 150000: not a number: 'oops'"):
        read_trace(path)


def test_million_rows_validate_fast() -> None:
    n = 1_000_000
    frame = pd.DataFrame(
        {
            "arrival_time_s": np.arange(n, dtype=np.float64)[::-1] / 10,
            "prompt_tokens": np.full(n, 100),
            "output_tokens": np.full(n, 10),
        }
    )
    trace = trace_from_frame(frame)
    assert len(trace) == n and trace.arrival_time_s[0] == 0.0 and trace.request_id[0] == str(n - 1)
    assert isinstance(trace, Trace)


def test_hash_lists_may_go_on_over_the_reply_but_no_further() -> None:
    frame = pd.DataFrame({"arrival_time_s": [0.0], "prompt_tokens": [10], "output_tokens": [7],
                          "block_hashes": [[1, 2, 3, 4, 5]], "hash_block_tokens": [4]})
    assert trace_from_frame(frame).block_hashes(0).tolist() == [1, 2, 3, 4, 5]  # 17 positions: 5 ids
    frame["block_hashes"] = [[1, 2, 3, 4, 5, 6]]
    with pytest.raises(TraceError, match=r"row 0: 6 hash ids, but 10 prompt \+ 7 output tokens .* at most 5"):
        trace_from_frame(frame, source="f.csv")
