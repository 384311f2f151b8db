"""The sweep table: one row per cell (cell order), the swept keys and the key summary metrics.
No wall-clock times, so the same sweep gives byte-identical files on any executor."""

from __future__ import annotations

import io
import math

import pyarrow as pa
import pyarrow.parquet as pq

from simkv.replay.results import largest_admission_limit
from simkv.sweep.grid import Cell, requested_block_size

# column -> path into summary.json
METRICS: dict[str, tuple[str, ...]] = {
    "num_requests": ("num_requests",),
    "num_finished": ("num_finished",),
    "num_gpu_blocks": ("num_gpu_blocks",),
    "num_steps": ("num_steps",),
    "duration_s": ("duration_s",),
    "peak_running": ("peak_running",),
    "num_preemptions": ("num_preemptions",),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate",),
    "internal_fragmentation_pct": ("internal_fragmentation_pct",),
    "ttft_p50_s": ("ttft_s", "p50"),
    "ttft_p99_s": ("ttft_s", "p99"),
    "itl_p50_s": ("itl_s", "p50"),
    "itl_p99_s": ("itl_s", "p99"),
    "e2e_p50_s": ("e2e_s", "p50"),
    "e2e_p99_s": ("e2e_s", "p99"),
    "output_throughput_tok_s": ("output_throughput_tok_s",),
    "request_throughput_req_s": ("request_throughput_req_s",),
}
INT_METRICS = {"num_requests", "num_finished", "num_gpu_blocks", "num_steps", "peak_running", "num_preemptions",
               "engine_block_size", "num_prefill_tokens", "offload_loaded_tokens", "offload_stored_blocks",
               "offload_evicted_blocks"}
# The block size the engine ran with, where a cell's differs from the one it asked for
# (grid.requested_block_size): cells asking for different sizes may run alike.
ENGINE_BLOCK_SIZE = "engine_block_size"
# with --goodput SLOs (only then, so that other sweeps' tables keep their columns)
GOODPUT_METRICS: dict[str, tuple[str, ...]] = {
    "slo_attainment": ("goodput", "slo_attainment"),
    "goodput_req_s": ("goodput", "request_goodput_req_s"),
}


# with KV offloading in some cell (only then): what the CPU tier saved and what it moved
OFFLOAD_METRICS: dict[str, tuple[str, ...]] = {
    "num_prefill_tokens": ("num_prefill_tokens",),
    "offload_loaded_tokens": ("kv_offloading", "loaded_tokens"),
    "offload_hit_rate": ("kv_offloading", "hit_rate"),
    "offload_stored_blocks": ("kv_offloading", "stored_blocks"),
    "offload_evicted_blocks": ("kv_offloading", "evicted_blocks"),
}


# with an autoscaled fleet in some cell (only then): what it paid and how many replicas were up
AUTOSCALE_METRICS: dict[str, tuple[str, ...]] = {
    "gpu_hours": ("fleet", "autoscaling", "gpu_hours"),
    "mean_replicas_up": ("fleet", "autoscaling", "mean_ready"),
}
# with GPU nodes under the replicas in some cell (--node-gpus): the share of the nodes' GPU-hours
# no replica held
NODE_METRICS: dict[str, tuple[str, ...]] = {"node_idle_share": ("fleet", "autoscaling", "nodes", "idle_gpu_share")}
# with failing replicas in some cell (simkv/replay/failures.py): the requests they lost, and those
# no retry saved
FAILURE_METRICS: dict[str, tuple[str, ...]] = {"requests_lost": ("fleet", "failures", "requests_lost"),
                                               "requests_failed": ("fleet", "failures", "requests_failed")}
# with scale-downs that end their replicas in some cell (shutdown_timeout): the requests they lost
SHUTDOWN_METRICS: dict[str, tuple[str, ...]] = {
    "shutdown_requests_lost": ("fleet", "autoscaling", "shutdown_requests_lost"),
    "shutdown_requests_failed": ("fleet", "autoscaling", "shutdown_requests_failed")}
# with --gpu-price (simkv sweep): what each cell's traffic cost on its setup
COST_METRICS: dict[str, tuple[str, ...]] = {"usd_spent": ("cost", "usd_spent"),
                                            "usd_per_1m_output_tokens": ("cost", "usd_per_1m_output_tokens")}
# (P/D pools that scale: both pools' GPU-hours and replicas up, in their section)
POOLS_AUTOSCALE_METRICS = {"gpu_hours": ("disaggregation", "autoscaling", "gpu_hours"),
                           "mean_replicas_up": ("disaggregation", "autoscaling", "mean_replicas_up"),
                           "node_idle_share": ("disaggregation", "autoscaling", "nodes", "idle_gpu_share")}


# with request classes in some cell's trace (simkv/replay/classes.py): per class, `CLASS:column`
CLASS_METRICS: dict[str, tuple[str, ...]] = {
    "ttft_p99_s": ("ttft_s", "p99"),
    "tpot_p99_s": ("tpot_s", "p99"),
    "itl_p99_s": ("itl_s", "p99"),
}


# the limit that held the waiting queue back longest (summary.json's admission_limits), and its share
HELD_BY = "waiting_held_by"


def metric_columns(rows: list[dict]) -> list[str]:
    """The metric columns the rows have (the goodput ones only when a cell was judged on SLOs,
    the offloading ones only when a cell offloads)."""
    named = [c for c in (*METRICS, *GOODPUT_METRICS, *OFFLOAD_METRICS, *AUTOSCALE_METRICS, *NODE_METRICS,
                         *FAILURE_METRICS, *SHUTDOWN_METRICS, *COST_METRICS) if rows and c in rows[0]]
    return named + [c for c in (rows[0] if rows else ()) if ":" in c]


def _get(summary: dict, path: tuple[str, ...]):
    value = summary
    for part in path:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def build_rows(cells: list[Cell], outcomes: dict[str, dict], swept_keys: list[str]) -> list[dict]:
    rows = []
    metrics = dict(METRICS) | (GOODPUT_METRICS if any(c.goodput for c in cells) else {})
    if any("kv_offloading" in ((outcomes.get(c.cell_id) or {}).get("summary") or {}) for c in cells):
        metrics |= OFFLOAD_METRICS
    if any(_get((outcomes.get(c.cell_id) or {}).get("summary") or {}, (section, "autoscaling"))
           for c in cells for section in ("fleet", "disaggregation")):
        metrics |= AUTOSCALE_METRICS
    if any(_get((outcomes.get(c.cell_id) or {}).get("summary") or {}, (section, "autoscaling", "nodes"))
           for c in cells for section in ("fleet", "disaggregation")):
        metrics |= NODE_METRICS
    if any(_get((outcomes.get(c.cell_id) or {}).get("summary") or {}, ("fleet", "failures")) for c in cells):
        metrics |= FAILURE_METRICS
    if any(_get((outcomes.get(c.cell_id) or {}).get("summary") or {}, ("fleet", "autoscaling", "shutdown_timeout_s"))
           is not None for c in cells):
        metrics |= SHUTDOWN_METRICS
    if any("cost" in ((outcomes.get(c.cell_id) or {}).get("summary") or {}) for c in cells):
        metrics |= COST_METRICS
    metrics |= _class_metrics(cells, outcomes)
    for cell in cells:
        out = outcomes.get(cell.cell_id, {"status": "failed", "error": "not run"})
        row = {"cell": cell.index, "cell_id": cell.cell_id, "trace": cell.trace}
        row |= {k: v for k, v in cell.swept if k in swept_keys}
        row["status"] = "ok" if out["status"] == "ok" else "failed"
        row["error"] = None if out["status"] == "ok" else out["error"]
        summary = out.get("summary") or {}
        for col, path in metrics.items():
            row[col] = _get(summary, path)
            if row[col] is None and col in POOLS_AUTOSCALE_METRICS:
                row[col] = _get(summary, POOLS_AUTOSCALE_METRICS[col])
        row[HELD_BY] = largest_admission_limit(summary) if out["status"] == "ok" else None
        rows.append(row)
    return _with_engine_block_size(cells, outcomes, rows)


def _class_metrics(cells: list[Cell], outcomes: dict[str, dict]) -> dict[str, tuple[str, ...]]:
    """`CLASS:column` for each request class some cell's summary has (in the order they first
    appear), with each class's SLO attainment where cells were judged on SLOs."""
    names: dict[str, None] = {}
    for c in cells:
        section = _get((outcomes.get(c.cell_id) or {}).get("summary") or {}, ("classes", "classes")) or {}
        names |= dict.fromkeys(section)
    per_class = dict(CLASS_METRICS) | ({"slo_attainment": ("slo_attainment",)} if any(c.goodput for c in cells) else {})
    return {f"{name}:{col}": ("classes", "classes", name, *path) for name in names for col, path in per_class.items()}


def _with_engine_block_size(cells: list[Cell], outcomes: dict[str, dict], rows: list[dict]) -> list[dict]:
    """The rows with an engine_block_size column after `error`, when some cell ran with another
    block size than it asked for (otherwise the rows unchanged)."""
    used = [_get((outcomes.get(c.cell_id) or {}).get("summary") or {}, ("config", "block_size")) for c in cells]
    asked = [requested_block_size(c.options) for c in cells]
    if all(u is None or u == a for u, a in zip(used, asked)):
        return rows
    out = []
    for row, u in zip(rows, used):
        new = {}
        for key, value in row.items():
            new[key] = value
            if key == "error":
                new[ENGINE_BLOCK_SIZE] = u
        out.append(new)
    return out


def _key_type(values: list) -> pa.DataType:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pa.bool_()
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return pa.int64()
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pa.float64()
    return pa.string()


def to_arrow(rows: list[dict], swept_keys: list[str]) -> pa.Table:
    columns = list(rows[0]) if rows else ["cell", "cell_id", "trace", *swept_keys, "status", "error", *METRICS]
    arrays, names = [], []
    for col in columns:
        values = [r.get(col) for r in rows]
        if col in ("cell",) or col in INT_METRICS:
            typ = pa.int64()
        elif col in swept_keys:
            typ = _key_type(values)
        elif col in METRICS or col in GOODPUT_METRICS or col in OFFLOAD_METRICS or col in AUTOSCALE_METRICS \
                or col in NODE_METRICS or col in FAILURE_METRICS or col in SHUTDOWN_METRICS or col in COST_METRICS \
                or ":" in col:  # (":": a request class's)
            typ = pa.float64()
        else:
            typ = pa.string()
        if typ == pa.string():
            values = [None if v is None else str(v) for v in values]
        elif typ == pa.float64():
            values = [None if v is None else float(v) for v in values]
        arrays.append(pa.array(values, type=typ))
        names.append(col)
    return pa.Table.from_arrays(arrays, names=names)


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def _cell_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    return str(value).replace("|", "\\|")


def markdown(rows: list[dict], title: str) -> str:
    if not rows:
        return f"# {title}\n\n(no cells)\n"
    cols = list(rows[0])
    lines = [f"# {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_cell_text(r.get(c)) for c in cols) + " |")
    failed = sum(r["status"] != "ok" for r in rows)
    lines += ["", f"{len(rows)} cells, {len(rows) - failed} ok, {failed} failed. "
              "Cell folders: cells/<cell_id>/ (summary.json or error.txt)."]
    return "\n".join(lines) + "\n"
