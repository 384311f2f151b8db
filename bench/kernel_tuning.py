"""From the benchmark's config sweep to a kernel tuning (``kernels/tuning.py``): the tiles each
launch class runs fastest with on this GPU, adopted only where the sweep shows a real gain.

For each class (decode, prefill) the sweep times several cases, each starting with the
launcher's default tiles. A candidate is a set of values of the class's tunable fields; it is
eligible when it was timed without error on every case of the class, with the case's default
KV split, its output agreed with the default's, and it was nowhere more than ``max_loss``
slower than the default (a tuning must not trade one shape's speed for another's). The
candidate with the smallest geometric mean of (its time / the default's time) over the cases
wins; it is adopted when that mean is at least ``min_gain`` below 1, else the class keeps the
heuristic. Plain Python on the sweep's rows.
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
from kernels.tuning import CLASS_KEYS, FORMAT, FORMAT_VERSION  # noqa: E402


def _case(row: dict) -> str:
    return f"{row['num_seqs']}x({row['context']}+{row['q_len']})"


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def choose_class(rows: list[dict], kind: str, min_gain: float, max_diff: float, max_loss: float) -> dict | None:
    """The verdict for one class from its sweep rows (in sweep order), or None without cases."""
    keys = CLASS_KEYS[kind]
    cases: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("kind") == kind and "ms" in r:
            cases.setdefault(_case(r), []).append(r)
    if not cases:
        return None
    ratios: dict[tuple, dict[str, float]] = {}
    times: dict[tuple, dict[str, float]] = {}
    defaults = {}
    for label, case_rows in cases.items():
        default = case_rows[0]["config"]
        defaults[label] = case_rows[0]
        for r in case_rows:
            cfg = r["config"]
            if cfg["num_segments"] != default["num_segments"] or r.get("max_diff_vs_first", 0.0) > max_diff:
                continue
            if kind == "decode" and cfg["block_m"] != default["block_m"]:
                continue
            cand = tuple(cfg.get(k, False) for k in keys)  # flags newer than a sweep's rows are off
            ratios.setdefault(cand, {})[label] = r["ms"] / case_rows[0]["ms"]
            times.setdefault(cand, {})[label] = r["ms"]
    default_cand = tuple(next(iter(defaults.values()))["config"].get(k, False) for k in keys)
    full = {c: v for c, v in ratios.items() if len(v) == len(cases) and max(v.values()) <= 1 + max_loss}
    if default_cand not in full:  # the cases disagree on the default: nothing to compare against
        return {"adopted": False, "why": "the cases' default tiles differ", "cases": sorted(cases)}
    best = min(full, key=lambda c: (_geomean(full[c].values()), c != default_cand))
    ratio = _geomean(full[best].values())
    verdict = {
        "default": dict(zip(keys, default_cand)), "best": dict(zip(keys, best)), "ratio": round(ratio, 4),
        "cases": {label: {"default_ms": defaults[label]["ms"], "best_ms": times[best][label]} for label in cases},
        "candidates": len(full),
    }
    verdict["adopted"] = best != default_cand and ratio <= 1 - min_gain
    if not verdict["adopted"]:
        verdict["why"] = ("the default is fastest" if best == default_cand
                          else f"best gain {100 * (1 - ratio):.1f}% < {100 * min_gain:.0f}%")
    return verdict


def tuning_from_sweep(sweep: list[dict], env: dict, min_gain: float = 0.03, max_diff: float = 2e-2,
                      max_loss: float = 0.02) -> dict:
    """A kernel-tuning record (``kernels/tuning.py``) from a sweep's rows and the benchmark's env."""
    record = {"format": FORMAT, "format_version": FORMAT_VERSION, "device": env.get("gpu", ""),
              "dtype": env.get("model_dtype"), "torch": env.get("torch"), "triton": env.get("triton"),
              "created": env.get("date"), "source": "bench/kernels.py config sweep",
              "rule": (f"geometric mean of time / default time over the class's cases <= {1 - min_gain:g}, "
                       f"no case slower than {1 + max_loss:g} x the default"),
              "evidence": {}}
    for kind in CLASS_KEYS:
        verdict = choose_class(sweep, kind, min_gain, max_diff, max_loss)
        if verdict is None:
            continue
        record["evidence"][kind] = verdict
        if verdict["adopted"]:
            record[kind] = verdict["best"]
    return record


def tuning_markdown(record: dict) -> list[str]:
    """The bench report's lines on the tuning it wrote."""
    out = ["## Tuned tiles (kernel_tuning.json)", "",
           f"Rule: {record['rule']}; the GPU check's later steps launch with the adopted tiles.", ""]
    for kind, v in record["evidence"].items():
        if "best" not in v:
            out.append(f"- {kind}: not tuned ({v['why']})")
            continue
        cases = ", ".join(f"{label} {c['default_ms']:.3f} -> {c['best_ms']:.3f} ms" for label, c in v["cases"].items())
        best = ", ".join(f"{k}={val}" for k, val in v["best"].items())
        head = f"adopted {best}" if v["adopted"] else f"kept the heuristic ({v['why']}; best {best})"
        out.append(f"- {kind}: {head}; time x{v['ratio']:.3f} of the default over {len(v['cases'])} cases ({cases})")
    return out + [""]
