"""Where a replay leaves the ground its calibration measured.

A fitted cost model is a regression: inside the range of the steps it was fitted on it
interpolates, beyond them it extrapolates a straight line that nothing checked. A replay that
runs 1,024 decodes per step on a calibration whose largest decode step had 256 predicts those
steps' times from a formula alone. `fitted_range` records, with the fit, the largest value of
each count the fitted steps reached; `range_coverage` says which of a replay's steps went past
it, on which count, and what share of the replay's time those steps take.

The counts (the replay's step log has all three):
  tokens                 tokens computed in a step (prefill + decode)
  decode_tokens          decode tokens in a step (the fit: its decode-only steps)
  decode_context_tokens  context tokens the step's decodes attend
"""

from __future__ import annotations

import numpy as np

RANGE_COUNTS = {
    "tokens": "tokens per step",
    "decode_tokens": "decode tokens per step",
    "decode_context_tokens": "decode context tokens per step",
}


def fitted_range(features) -> dict[str, int]:
    """The largest value of each count over fitted steps given as an [N, 5] array of
    (T, S, Pp, Kp, Kd) (`simkv.calibration.costmodel.step_features`)."""
    f = np.asarray(features, dtype=np.int64).reshape(-1, 5)
    decode_only = (f[:, 2] == 0) & (f[:, 3] == 0)
    return {"tokens": int(f[:, 0].max(initial=0)),
            "decode_tokens": int(f[decode_only, 0].max(initial=0)),
            "decode_context_tokens": int(f[:, 4].max(initial=0))}


def replay_counts(steps: dict) -> dict[str, np.ndarray]:
    """The same counts per step of a replay's step columns (`StepLog.columns`)."""
    decodes = np.asarray(steps["num_decode_tokens"], dtype=np.int64)
    return {"tokens": np.asarray(steps["num_prefill_tokens"], dtype=np.int64) + decodes,
            "decode_tokens": decodes,
            "decode_context_tokens": np.asarray(steps["decode_context_tokens"], dtype=np.int64)}


def range_coverage(fitted: dict, steps: dict) -> dict:
    """Per count: the calibration's largest, the replay's largest and the steps beyond; and
    over all counts, the steps beyond any of them and their share of steps and of time."""
    counts = replay_counts(steps)
    durations = np.asarray(steps["duration_s"], dtype=np.float64)
    beyond = np.zeros(len(durations), dtype=bool)
    per_count = {}
    for name, values in counts.items():
        over = values > int(fitted[name])
        beyond |= over
        per_count[name] = {"calibrated_max": int(fitted[name]), "replay_max": int(values.max(initial=0)),
                           "steps_beyond": int(over.sum())}
    total = float(durations.sum())
    return {"counts": per_count, "steps_beyond": int(beyond.sum()),
            "share_of_steps_beyond": float(beyond.mean()) if len(beyond) else 0.0,
            "share_of_time_beyond": float(durations[beyond].sum() / total) if total > 0 else 0.0}


def coverage_warning(coverage: dict, source: str) -> str | None:
    """One line for the terminal when some steps lie beyond the calibrated range (None if none do)."""
    if not coverage.get("steps_beyond"):
        return None
    parts = [f"{RANGE_COUNTS[name]} up to {c['replay_max']:,} (measured up to {c['calibrated_max']:,})"
             for name, c in coverage["counts"].items() if c["steps_beyond"]]
    options = [option for name, option in (("decode_tokens", "--max-num-seqs"), ("tokens", "--max-num-batched-tokens"))
               if coverage["counts"][name]["steps_beyond"]]
    hint = f"; calibrate with {' and '.join(options)} as large as the replay's" if options else ""
    return (f"{coverage['steps_beyond']:,} steps ({100 * coverage['share_of_time_beyond']:.1f} % of the replay's time) "
            f"lie beyond what {source} measured: {'; '.join(parts)}. Their times are the fit extrapolated{hint}")


def cost_model_warnings(described: dict, source: str) -> list[str]:
    """What a user should hear about a replay's cost model (its `summary.json` description): a
    calibration's version drift, and the steps beyond its calibrated range."""
    beyond = coverage_warning(described["calibrated_range"], source) if "calibrated_range" in described else None
    return list(described.get("warnings") or []) + ([beyond] if beyond else [])
