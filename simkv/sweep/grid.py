"""Grid parsing and the cells of a sweep (trace x option combination), with stable cell ids."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass

from simkv.config import CacheConfig, engine_option_names
from simkv.replay.autoscale import SETTINGS as AUTOSCALE_SETTINGS

COST_KEYS = ("step_base_s", "step_per_token_s")  # options of the linear cost model
ENGINE_KEYS = engine_option_names()
# A fleet of the engine behind a router (simkv/replay/fleet.py), and prefix_aware's thresholds;
# or a prefill pool and a decode pool (simkv/replay/disaggregated.py).
PD_KEYS = ("prefill_replicas", "decode_replicas", "prefill_router", "decode_router", "kv_link_gbps",
           "kv_link_latency_ms", "handoff_ms", "kv_abort_timeout_s", "prefill_autoscale", "decode_autoscale")
# An encode pool in front (simkv/replay/encode_pool.py; the store's bandwidth: the engine option ec_store_gbs).
ENCODE_KEYS = ("encode_replicas", "encode_router", "encode_hop_ms")
# class_replicas: replicas of a request class's own, one value "docs=3" or "docs=2-3;chat=0-1"
# (in a config file, a mapping), kept as that canonical text. replica_sets: replicas of other
# engines, one value "2-3:gpu=H200,tensor_parallel_size=2" or "0-1:gpu=H200;2:gpu=A100-80GB"
# (a config file's mapping {"2-3": {gpu: H200}}), kept as canonical text too.
TEXT_KEYS = ("class_replicas", "replica_sets")
# autoscale: "MIN-MAX" (simkv/replay/autoscale.py), with its settings
AUTOSCALE_KEYS = ("autoscale", *AUTOSCALE_SETTINGS)
# replicas that fail (simkv/replay/failures.py): replica_failures "T:R" or "T:R;T:R", and the rest
FAILURE_KEYS = ("replica_failures", "restart_s", "replica_mtbf_s", "failure_seed")
FLEET_KEYS = (("replicas", "router", "cache_threshold", "balance_abs", "balance_rel") + TEXT_KEYS
              + PD_KEYS + ENCODE_KEYS + AUTOSCALE_KEYS + FAILURE_KEYS)
SWEEPABLE_KEYS = ENGINE_KEYS + ("cost_model",) + COST_KEYS + FLEET_KEYS


class SweepError(ValueError):
    """A bad grid, option or value: one line that names it."""


def parse_value(text: str):
    """'16' -> 16, '0.01' -> 0.01, 'true'/'false' -> bool, 'none'/'null' -> None, anything else -> str."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def normalize_key(key: str, flag: str) -> str:
    norm = key.strip().replace("-", "_")
    if norm not in SWEEPABLE_KEYS:
        raise SweepError(f"{flag}: unknown option '{key}'; known options: {', '.join(sorted(SWEEPABLE_KEYS))}")
    return norm


def parse_assignment(text: str, flag: str = "--set") -> tuple[str, object]:
    """'KEY=VALUE' -> (key, typed value)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise SweepError(f"{flag}: expected KEY=VALUE, got '{text}'")
    key = normalize_key(key, flag)
    return key, typed_value(key, value, flag)


def typed_value(key: str, value, flag: str):
    """An option's value as a cell holds it: parse_value's, or class_replicas' or replica_sets'
    canonical text."""
    if key == "class_replicas":
        return class_replicas_text(value, flag)
    if key == "replica_sets":
        return replica_sets_text(value, flag)
    return parse_value(value) if isinstance(value, str) else value


def replica_sets_text(value, flag: str) -> str | None:
    """'2-3:gpu=H200,tensor_parallel_size=2;0:gpu=A100-80GB' or {"2-3": {gpu: H200}} -> the
    canonical line (sets by first replica, options by name; checked; None stays)."""
    from simkv.replay.router import RouterError, parse_replica_sets, replica_set_items_of
    from simkv.replay.router import replica_sets_text as canonical

    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    try:
        if isinstance(value, dict):
            items = replica_set_items_of(value)
        elif isinstance(value, str):
            items = [part.strip() for part in value.split(";") if part.strip()]
        else:
            raise RouterError(f"expected REPLICAS:KEY=VALUE,...[;REPLICAS:KEY=VALUE,...] (2-3:gpu=H200), got {value!r}")
        return canonical(parse_replica_sets(items))
    except RouterError as exc:
        raise SweepError(f"{flag}: replica_sets: {str(exc).replace('--replica-set ', '')}") from None


# (a replica_sets value holds commas of its own: a grid value begins with "none" or "REPLICAS:")
_REPLICA_SET_START = re.compile(r"\s*(none|null|\d+(-\d+)?\s*:)", re.IGNORECASE)


def _grid_values(key: str, text: str) -> list[str]:
    """A --grid's values: split at commas, but a replica_sets value keeps its options' commas."""
    parts = text.split(",")
    if key != "replica_sets":
        return parts
    values: list[str] = []
    for part in parts:
        if values and part.strip() and not _REPLICA_SET_START.match(part):
            values[-1] += "," + part
        else:
            values.append(part)
    return values


def class_replicas_text(value, flag: str) -> str | None:
    """'docs=2-3;chat=0,1' or {docs: '2-3', chat: [0, 1]} -> 'docs=2,3;chat=0,1' (checked; None stays)."""
    from simkv.replay.router import RouterError, class_replica_items_of, parse_class_replicas

    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    if isinstance(value, dict):
        items = class_replica_items_of(value)
    elif isinstance(value, str):
        items = [part for part in value.split(";") if part.strip()]
    else:
        raise SweepError(f"{flag}: class_replicas is CLASS=REPLICAS[;CLASS=REPLICAS] (docs=3 or docs=2-3;chat=0-1), "
                         f"got {value!r}")
    try:
        parsed = parse_class_replicas([item.strip() for item in items])
    except RouterError as exc:
        raise SweepError(f"{flag}: class_replicas: {str(exc).replace('--class-replicas ', '')}") from None
    return ";".join(f"{name}={','.join(map(str, replicas))}" for name, replicas in parsed)


def parse_grid(specs: list[str]) -> dict[str, list]:
    """['block_size=8,16', 'watermark=0,0.01'] -> {'block_size': [8, 16], 'watermark': [0, 0.01]} (order kept)."""
    grid: dict[str, list] = {}
    for text in specs:
        key, sep, values = text.partition("=")
        if not sep or not key.strip():
            raise SweepError(f"--grid: expected KEY=V1,V2,..., got '{text}'")
        norm = normalize_key(key, "--grid")
        if norm in grid:
            raise SweepError(f"--grid: option '{norm}' is given twice")
        parts = _grid_values(norm, values)
        if any(not v.strip() for v in parts):
            raise SweepError(f"--grid: empty value in '{text}'")
        typed = [typed_value(norm, v, "--grid") for v in parts]
        if len({json.dumps(v) for v in typed}) != len(typed):
            raise SweepError(f"--grid: repeated value in '{text}'")
        grid[norm] = typed
    return grid


def requested_block_size(options) -> int:
    """The block size a cell's engine options ask for (CacheConfig's default when none); the
    engine may run another (vLLM grows it for hybrid models, some latent-attention backends
    pick theirs)."""
    return dict(options).get("block_size") or CacheConfig().block_size


@dataclass(frozen=True)
class Cell:
    """One replay of a sweep: a trace and every option in force (fixed options + this combination)."""

    index: int
    trace: str
    swept: tuple[tuple[str, object], ...]  # the swept keys' values, in grid order
    options: tuple[tuple[str, object], ...]  # engine options (fixed + swept), sorted by name
    cost_model: str
    cost_options: tuple[tuple[str, object], ...]
    goodput: tuple[tuple[str, float], ...] = ()  # latency SLOs in ms (--goodput), judged per cell
    fleet: tuple[tuple[str, object], ...] = ()  # replicas and router, when given

    @property
    def cell_id(self) -> str:
        """Stable across runs and machines: a hash of the trace path and every option (and the
        SLOs, when given: a cell judged on other SLOs is another cell)."""
        spec = {"trace": self.trace, "options": dict(self.options), "cost_model": self.cost_model,
                "cost_options": dict(self.cost_options)}
        if self.goodput:
            spec["goodput"] = dict(self.goodput)
        if self.fleet:
            spec["fleet"] = dict(self.fleet)
        key = json.dumps(spec, sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def task(self) -> dict:
        """What a worker needs (plain data, picklable)."""
        task = {"cell_id": self.cell_id, "trace": self.trace, "options": dict(self.options),
                "cost_model": self.cost_model, "cost_options": dict(self.cost_options)}
        return (task | ({"goodput": dict(self.goodput)} if self.goodput else {})
                | ({"fleet": dict(self.fleet)} if self.fleet else {}))


def make_cells(traces: list[str], grid: dict[str, list], fixed: dict, cost_model: str,
               goodput: dict[str, float] | None = None) -> list[Cell]:
    """Traces outermost, then the grid's keys in the order given (the last key varies fastest)."""
    cells = []
    keys = list(grid)
    for trace in traces:
        trace = os.path.normpath(trace)
        for combo in itertools.product(*(grid[k] for k in keys)):
            merged = dict(fixed) | dict(zip(keys, combo))
            model = merged.pop("cost_model", cost_model)
            cost_opts = {k: merged.pop(k) for k in COST_KEYS if k in merged}
            fleet = {k: merged.pop(k) for k in FLEET_KEYS if k in merged}
            cells.append(Cell(len(cells), trace, tuple(zip(keys, combo)), tuple(sorted(merged.items())),
                              str(model), tuple(sorted(cost_opts.items())), tuple((goodput or {}).items()),
                              tuple(sorted(fleet.items()))))
    return cells
