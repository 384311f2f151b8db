"""A run measured by vLLM's multi-turn benchmark, read as `simkv compare`'s measured side.

`benchmark_serving_multi_turn.py --stats-json-output stats.json` writes one object per request
it counted: ``ttft_ms``, ``tpot_ms``, ``latency_ms``, ``start_time_ms``, ``input_num_turns``
(the messages sent: 2k + 1 for user turn k), ``input_num_tokens`` (the messages' text, without
the chat template), ``output_num_tokens``, ``conversation_id`` and ``client_id``, among others.
Each is matched to the simulated run's request ``<conversation_id>/turn<k>`` (the names
`simkv replay --vllm-multi-turn` and `simkv trace from-vllm-multi-turn` give). The benchmark
counts only the requests it sent before it stopped, so both sides are compared over the
matched requests (and where it did not stream, `output_num_chunks` 0 everywhere, its TTFT is the
whole answer's time and it has no TPOT: the simulated TTFT is taken as the whole answer's too,
and TPOT is left out): the simulated run's figures are recomputed over them (duration from the first
send to the last finish, throughputs, TTFT, TPOT, E2E); its engine-wide figures (steps,
preemptions, prefix hits) stay the whole run's, and the benchmark measures none of them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.replay.results import dist

FIELDS = ("ttft_ms", "tpot_ms", "latency_ms", "start_time_ms", "input_num_turns", "output_num_tokens",
          "conversation_id")


def multi_turn_records(path: str | Path) -> list[dict] | None:
    """The multi-turn benchmark's per-request records, if `path` is a JSON list of them (None:
    it is not: another file, or vllm bench serve's result object)."""
    if not (Path(path).is_file() and str(path).endswith(".json")):
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data) and "conversation_id" in data[0]:
        return data
    return None


def _span(sent: np.ndarray, finish: np.ndarray) -> float:
    return float(np.nanmax(finish) - np.nanmin(sent)) if len(sent) else 0.0


def _summary(base: dict, requests: pd.DataFrame, sent: np.ndarray, finish: np.ndarray) -> dict:
    """`base` with the figures of `requests` (finished): duration, throughputs, latencies."""
    duration = _span(sent, finish)
    out = requests["output_tokens"].to_numpy(dtype=np.float64)
    return base | {
        "num_requests": int(len(requests)), "num_finished": int(len(requests)), "duration_s": duration,
        "request_throughput_req_s": len(requests) / duration if duration else 0.0,
        "output_throughput_tok_s": float(out.sum()) / duration if duration else 0.0,
        "ttft_s": dist(requests["ttft_s"].to_numpy()), "e2e_s": dist(requests["e2e_s"].to_numpy()),
        "tpot_s": dist(requests["mean_itl_s"].to_numpy()), "queue_s": dist(requests["queue_s"].to_numpy()),
        "itl_s": {"mean": None, "p50": None, "p90": None, "p99": None}}


def load_multi_turn_run(path: str | Path, records: list[dict], sim: dict, sim_requests: pd.DataFrame) -> tuple:
    """(simulated summary, simulated requests, measured summary, measured requests), both over
    the requests the benchmark counted (`records`, read from `path`: `multi_turn_records`); a
    one-line ValueError naming the first record that the simulated run lacks."""
    missing = [f for f in FIELDS if f not in records[0]]
    if missing:
        raise ValueError(f"{path}: records lack {', '.join(missing)}")
    ids = [f"{r['conversation_id']}/turn{(int(r['input_num_turns']) - 1) // 2}" for r in records]
    known = sim_requests.set_index("request_id")
    absent = [i for i in ids if i not in known.index]
    if absent:
        raise ValueError(f"{path}: request '{absent[0]}' (and {len(absent) - 1} more) is not in the simulated run: "
                         "simulate the same command (simkv replay --vllm-multi-turn) or its generator file")
    streamed = not all(r.get("output_num_chunks", 1) == 0 for r in records)  # (--no-stream: none)
    start = np.array([r["start_time_ms"] for r in records], dtype=float) / 1e3
    latency = np.array([r["latency_ms"] for r in records], dtype=float) / 1e3
    measured = pd.DataFrame({
        "request_id": ids, "sent_time_s": start - start.min(), "status": "finished",
        "prompt_tokens": known.loc[ids, "prompt_tokens"].to_numpy(),
        "output_tokens": np.array([r["output_num_tokens"] for r in records], dtype=np.int64),
        "queue_s": np.nan, "ttft_s": np.array([r["ttft_ms"] for r in records], dtype=float) / 1e3, "e2e_s": latency,
        "mean_itl_s": np.array([r["tpot_ms"] if streamed else np.nan for r in records], dtype=float) / 1e3})
    meas = _summary({"backend": "vllm-multi-turn", "device": None, "config": {}, "trace": None},
                    measured, start, start + latency)
    meas["vllm_bench"] = {"tool": "vLLM's multi-turn benchmark", "completed": len(records), "failed": 0,
                          "clients": len({r.get("client_id") for r in records})}
    sim_sub = sim_requests[sim_requests["request_id"].isin(set(ids)) & (sim_requests["status"] == "finished")]
    if not streamed:  # (one chunk, at the end)
        sim_sub = sim_sub.assign(ttft_s=sim_sub["e2e_s"], mean_itl_s=np.nan)
    sim_sent = sim_sub["arrival_time_s"].to_numpy()
    sim_out = _summary(sim, sim_sub, sim_sent, sim_sub["finish_time_s"].to_numpy())
    return sim_out, sim_sub.reset_index(drop=True), meas, measured
