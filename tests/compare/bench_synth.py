"""A `vllm bench serve --save-detailed` result made from a replay's folder, without HTTP: what
the benchmark client would record if a server produced each token at the replay's times (the
first token, then one at the end of every step the request decoded in). Tests use it as a
server whose true timing is known; scripts/vllm_bench_roundtrip.py streams the same times
through vLLM's real client."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from simkv.compare.token_times import simulated_token_times


def bench_result(sim_dir: Path) -> dict:
    req, times, _ = simulated_token_times(sim_dir)
    arrival = req["arrival_time_s"].to_numpy()
    ttfts = [t[0] - a for t, a in zip(times, arrival)]
    latencies = [t[-1] - a for t, a in zip(times, arrival)]
    return {"date": "synthetic", "backend": "vllm", "model_id": "synthetic", "num_prompts": len(req),
            "duration": float(max(t[-1] for t in times)), "completed": len(req), "failed": 0,
            "input_lens": (req["prompt_tokens"] - req.get("mm_tokens", 0)).tolist(),  # (the client: the text)
            "output_lens": req["output_tokens"].tolist(),
            "ttfts": ttfts, "itls": [np.diff(t).tolist() for t in times], "latencies": latencies,
            "start_times": (1000.0 + arrival).tolist(), "errors": [""] * len(req)}


def write_bench_result(sim_dir: Path, path: Path) -> Path:
    path.write_text(json.dumps(bench_result(sim_dir)))
    return path
