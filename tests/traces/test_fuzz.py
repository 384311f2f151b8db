"""Property tests: mangled inputs give a clean TraceError or a correct import, never a crash or a hang."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.traces import TraceError, read_trace, trace_from_frame
from simkv.traces.importers import ColumnMap, import_to_file, import_trace

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

VALID_CSV = (
    b"arrival_time_s,prompt_tokens,output_tokens,block_hashes,hash_block_tokens,cache_salt\n"
    b'0.5,40,3,"1 2 3",16,a\n0.0,17,1,"[4, 5]",16,\n2,9000000,12,,,b\n'
)
VALID_JSONL = (
    b'{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}\n'
    b'{"timestamp": 27, "input_length": 600, "output_length": 9, "hash_ids": [0, 2]}\n'
)
VALID_CONVERSATION = json.dumps({
    "block_size": 64,
    "requests": [
        {"t": 0.0, "in": 200, "out": 20, "hash_ids": [1, 2, 3]},
        {"type": "subagent", "agent_id": "a", "requests": [{"t": 3.0, "in": 130, "out": 4, "hash_ids": [1, 7]}]},
        {"t": 9.5, "in": 300, "out": 5, "hash_ids": [1, 2, 3, 4]},
    ],
}).encode()

junk = st.one_of(
    st.binary(max_size=12),
    st.sampled_from([b"\xff\xfe", b"\x00", b",", b"\n", b'"', b"[", b"]", b"-", b"nan", b"1e400",
                     b"99999999999999999999999", b"abc", b"{", b"}", b" ", b"\r\n", b"true", b"null"]),
)


@st.composite
def mangled(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` after a few truncations, overwrites and insertions."""
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["truncate", "insert", "replace"]))
        piece = draw(junk)
        if action == "truncate":
            data = data[:at]
        elif action == "insert":
            data = data[:at] + piece + data[at:]
        else:
            data = data[:at] + piece + data[at + len(piece):]
    return data


def clean_or_error(call) -> object:
    try:
        return call()
    except TraceError as exc:
        message = str(exc)
        assert message and "\n" not in message and "Traceback" not in message
        return None


@pytest.mark.timeout(120)
@FUZZ
@given(content=mangled(VALID_CSV))
def test_read_trace_on_mangled_csv(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "m.csv"
    path.write_bytes(content)
    trace = clean_or_error(lambda: read_trace(path))
    if trace is not None:
        assert len(trace) >= 1 and (trace.prompt_tokens >= 1).all() and (trace.output_tokens >= 1).all()


@pytest.mark.timeout(120)
@FUZZ
@given(cut=st.integers(0, 2000), flip=st.integers(0, 2000), byte=st.integers(0, 255))
def test_read_trace_on_damaged_parquet(tmp_path: Path, cut: int, flip: int, byte: int) -> None:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [3, 4], "output_tokens": [1, 2]}), buffer)
    data = bytearray(buffer.getvalue())
    if flip < len(data):
        data[flip] = byte
    path = tmp_path / "d.parquet"
    path.write_bytes(bytes(data[: max(cut, 0)] if cut < len(data) else data))
    clean_or_error(lambda: read_trace(path))


@pytest.mark.timeout(120)
@FUZZ
@given(content=mangled(VALID_JSONL))
def test_mooncake_on_mangled_lines(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(content)
    out = tmp_path / "out.parquet"
    out.unlink(missing_ok=True)  # hypothesis reuses tmp_path across examples
    report = clean_or_error(lambda: import_to_file("mooncake", [path], out))
    if report is None:
        assert not out.exists()
    else:
        assert read_trace(out) == import_trace("mooncake", [path])[0]


@pytest.mark.timeout(120)
@FUZZ
@given(content=mangled(VALID_CONVERSATION))
def test_kvcache_tester_on_mangled_json(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(content)
    clean_or_error(lambda: import_trace("kvcache-tester", [path]))


@pytest.mark.timeout(120)
@FUZZ
@given(content=mangled(b"Timestamp,Request tokens,Response tokens\n0.5,12,3\n1.25,40,0\n2,7,7\n"))
def test_csv_import_on_mangled_rows(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "b.csv"
    path.write_bytes(content)
    mapping = ColumnMap("Timestamp", "Request tokens", "Response tokens")
    out = tmp_path / "o.parquet"
    out.unlink(missing_ok=True)
    report = clean_or_error(lambda: import_to_file("csv", [path], out, mapping=mapping))
    if report is None:
        assert not out.exists()


cells = st.one_of(
    st.integers(-5, 2**70), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.none(),
    st.booleans(), st.lists(st.integers(-3, 2**64), max_size=3),
)


@pytest.mark.timeout(120)
@FUZZ
@given(rows=st.lists(st.tuples(cells, cells, cells, cells), min_size=0, max_size=5))
def test_trace_from_frame_on_random_cells(rows: list) -> None:
    frame = pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens", "block_hashes"])
    frame["hash_block_tokens"] = 4
    clean_or_error(lambda: trace_from_frame(frame))
