"""When each request of a replay produced its tokens: the first token, then one at the end of
every step it decoded in (the steps ending after its first token and up to its finish), evenly
spaced where those are not one fewer than its output tokens (a preempted request's gap). What a
server that ran as simulated would stream; numpy and pandas only, so that the vLLM oracle's
Python (scripts/vllm_bench_roundtrip.py) reads it too."""
from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import pandas as pd


def simulated_token_times(sim_dir: str | Path) -> tuple[pd.DataFrame, list[list[float]], int]:
    """(the replay's requests table, each request's token times, how many came from its steps)."""
    sim_dir = Path(sim_dir)
    requests = pd.read_parquet(sim_dir / "requests.parquet")
    steps = pd.read_parquet(sim_dir / "steps.parquet")
    ends = (steps["start_time_s"] + steps["duration_s"]).to_numpy()
    times, from_steps = [], 0
    for r in requests.itertuples():
        first, finish, o = float(r.first_token_time_s), float(r.finish_time_s), int(r.output_tokens)
        later = ends[bisect.bisect_right(ends, first + 1e-12):bisect.bisect_right(ends, finish + 1e-12)].tolist()
        if len(later) == o - 1:
            from_steps += 1
        else:
            later = np.linspace(first, finish, o)[1:].tolist() if o > 1 else []
        times.append([first] + later)
    return requests, times, from_steps
