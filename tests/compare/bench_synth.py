"""A `vllm bench serve --save-detailed` result made from a replay's folder, without HTTP: what
the benchmark client would record if a server produced each token at the replay's times (the
first token, then one at the end of every step the request decoded in). Tests use it as a
server whose true timing is known; scripts/vllm_bench_roundtrip.py streams the same times
through vLLM's real client."""
from __future__ import annotations

import bisect
import json
from pathlib import Path

import numpy as np
import pandas as pd


def token_times(sim_dir: Path) -> list[list[float]]:
    req = pd.read_parquet(sim_dir / "requests.parquet")
    steps = pd.read_parquet(sim_dir / "steps.parquet")
    ends = (steps["start_time_s"] + steps["duration_s"]).to_numpy()
    out = []
    for r in req.itertuples():
        first, finish, o = float(r.first_token_time_s), float(r.finish_time_s), int(r.output_tokens)
        later = ends[bisect.bisect_right(ends, first + 1e-12):bisect.bisect_right(ends, finish + 1e-12)].tolist()
        if len(later) != o - 1:
            later = np.linspace(first, finish, o)[1:].tolist() if o > 1 else []
        out.append([first] + later)
    return out


def bench_result(sim_dir: Path) -> dict:
    req = pd.read_parquet(sim_dir / "requests.parquet")
    times = token_times(sim_dir)
    arrival = req["arrival_time_s"].to_numpy()
    ttfts = [t[0] - a for t, a in zip(times, arrival)]
    latencies = [t[-1] - a for t, a in zip(times, arrival)]
    return {"date": "synthetic", "backend": "vllm", "model_id": "synthetic", "num_prompts": len(req),
            "duration": float(max(t[-1] for t in times)), "completed": len(req), "failed": 0,
            "input_lens": req["prompt_tokens"].tolist(), "output_lens": req["output_tokens"].tolist(),
            "ttfts": ttfts, "itls": [np.diff(t).tolist() for t in times], "latencies": latencies,
            "start_times": (1000.0 + arrival).tolist(), "errors": [""] * len(req)}


def write_bench_result(sim_dir: Path, path: Path) -> Path:
    path.write_text(json.dumps(bench_result(sim_dir)))
    return path
