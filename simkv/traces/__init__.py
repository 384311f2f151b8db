"""Request traces: the canonical schema, importers, generators, statistics and transforms."""
from simkv.traces.errors import TraceError
from simkv.traces.schema import (
    Trace,
    read_trace,
    trace_from_frame,
    trace_from_table,
    trace_to_frame,
    trace_to_table,
    write_trace,
)

__all__ = [
    "Trace",
    "TraceError",
    "read_trace",
    "trace_from_frame",
    "trace_from_table",
    "trace_to_frame",
    "trace_to_table",
    "write_trace",
]
