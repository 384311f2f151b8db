"""``simkv trace import``: raw public trace formats -> the canonical schema.

Every importer yields canonical Arrow tables in the source's order and fills an ImportReport.
``import_to_file`` streams those tables into a parquet file (temp file + rename: nothing
half-written); ``import_trace`` collects them into a validated, sorted Trace.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa

from simkv.traces._tableio import ParquetBatchWriter, atomic_path, file_kind
from simkv.traces.errors import TraceError
from simkv.traces.importers.kvcache_tester import ConversationStarts, kvcache_batches
from simkv.traces.importers.mooncake import mooncake_batches
from simkv.traces.importers.report import ImportReport
from simkv.traces.importers.tabular import AZURE, ColumnMap, tabular_batches
from simkv.traces.schema import Trace, trace_from_table, write_trace

FORMATS = ("mooncake", "azure", "burstgpt", "kvcache-tester", "csv", "vllm-bench")

__all__ = ["FORMATS", "ColumnMap", "ConversationStarts", "ImportReport", "import_to_file", "import_trace"]


def import_batches(
    fmt: str,
    sources: Sequence[str | os.PathLike],
    report: ImportReport,
    *,
    block_tokens: int = 512,
    mapping: ColumnMap | None = None,
    starts: ConversationStarts = ConversationStarts(),
    models: tuple[str, ...] = (),
    log_type: str | None = None,
) -> Iterator[pa.Table]:
    """Canonical tables of one import, in source order."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown import format {fmt!r} (choose from {', '.join(FORMATS)})")
    if fmt != "burstgpt" and (models or log_type is not None):
        raise TraceError("--model-name and --log-type select rows of a burstgpt import")
    if fmt == "kvcache-tester":
        return kvcache_batches(list(sources), report, starts)
    if len(sources) != 1:
        raise TraceError(f"format {fmt!r} takes exactly one source file, got {len(sources)}")
    source = Path(sources[0])
    if not source.is_file():
        raise TraceError(f"{source}: no such file")
    if fmt == "mooncake":
        return mooncake_batches(source, report, block_tokens)
    if fmt == "azure":
        return tabular_batches(source, AZURE, report)
    if fmt == "burstgpt":
        from simkv.traces.importers.burstgpt import burstgpt_batches

        return burstgpt_batches(source, report, models, log_type)
    if fmt == "vllm-bench":
        from simkv.traces.importers.vllm_bench import vllm_bench_batches

        return vllm_bench_batches(source, report)
    if mapping is None:
        raise TraceError("format 'csv' needs a column mapping (--time-col, --prompt-col, --output-col)")
    return tabular_batches(source, mapping, report)


def import_trace(fmt: str, sources: Sequence[str | os.PathLike], **options: object) -> tuple[Trace, ImportReport]:
    """Import into memory: the validated Trace (sorted by arrival) and the report."""
    report = ImportReport(source=_label(sources))
    tables = list(import_batches(fmt, sources, report, **options))  # type: ignore[arg-type]
    if not tables:
        raise TraceError(f"{report.source}: no requests left to import ({report.summary()})")
    table = pa.concat_tables(tables)
    report.rows_kept = table.num_rows
    return trace_from_table(table, source=report.source), report


def import_to_file(
    fmt: str, sources: Sequence[str | os.PathLike], out: str | os.PathLike, **options: object
) -> ImportReport:
    """Import straight into ``out``. Parquet output is streamed batch by batch (bounded memory)."""
    if file_kind(out) != "parquet":
        trace, report = import_trace(fmt, sources, **options)
        write_trace(trace, out)
        return report
    report = ImportReport(source=_label(sources))
    with atomic_path(out) as temp:
        _stream(import_batches(fmt, sources, report, **options), temp, report)  # type: ignore[arg-type]
    return report


def _stream(tables: Iterator[pa.Table], temp: str, report: ImportReport) -> None:
    writer: ParquetBatchWriter | None = None
    try:
        for table in tables:
            trace_from_table(table, source=report.source, row_offset=report.rows_kept)
            if writer is None:
                writer = ParquetBatchWriter(temp, table.schema)
            writer.write(table.cast(writer.schema))
            report.rows_kept += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise TraceError(f"{report.source}: no requests left to import ({report.summary()})")


def _label(sources: Sequence[str | os.PathLike]) -> str:
    if len(sources) == 1:
        return str(sources[0])
    return f"{sources[0]} (+{len(sources) - 1} more)" if sources else "<nothing>"
