"""The KV-budget gateway study's table (docs/studies.md, "A gateway that admits by KV
footprint"), regenerated.

The bundled Azure conversation slice at 6x its rate, llama-3-8b on one H100 with vLLM 0.33's
defaults (1,024 sequences, 8,192-token steps), replayed as it comes and behind a gateway that
keeps the requests in flight at most T prompt + output tokens (`client_max_inflight_tokens`:
a request's KV footprint at its max_tokens, taken here as its trace output), T from the KV
cache's 466,560 tokens down. TTFT at the engine counts from when the gateway sent the request;
the user's TTFT adds the wait in the gateway. Prints one markdown row per setting.

    .venv/bin/python scripts/study_kv_gateway.py
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.config import EngineConfig  # noqa: E402
from simkv.replay.api import replay  # noqa: E402
from simkv.traces.schema import read_trace  # noqa: E402

BUDGETS = (None, 466_560, 350_000, 250_000, 150_000)


def main() -> None:
    base = read_trace(ROOT / "traces" / "azure_conv_slice.parquet")
    trace = replace(base, arrival_time_s=base.arrival_time_s / 6)
    arrived = dict(zip(trace.request_id.tolist(), trace.arrival_time_s.tolist()))
    print("| gateway budget (tokens) | peak running | preemptions | requests held (mean wait s) | "
          "TTFT at the engine p50 / p99 s | user's TTFT p50 / p99 s | TPOT mean ms | req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for budget in BUDGETS:
        result = replay(trace, EngineConfig.from_flat({} if budget is None else {"client_max_inflight_tokens": budget}))
        s, r = result.summary, result.requests
        waited = r["arrival_time_s"].to_numpy() - np.array([arrived[i] for i in r["request_id"]])
        user = waited + r["ttft_s"].to_numpy()
        cc = s.get("client_concurrency", {"requests_held": 0, "mean_hold_s": 0.0})
        print(f"| {'none' if budget is None else f'{budget:,}'} | {s['peak_running']:,} | {s['num_preemptions']:,} | "
              f"{cc['requests_held']:,} ({cc['mean_hold_s']:.2f}) | "
              f"{s['ttft_s']['p50']:.2f} / {s['ttft_s']['p99']:.2f} | "
              f"{np.percentile(user, 50):.2f} / {np.percentile(user, 99):.2f} | {1e3 * s['tpot_s']['mean']:.1f} | "
              f"{s['request_throughput_req_s']:.2f} |", flush=True)
    print(f"({time.perf_counter() - t0:.1f} s for {len(BUDGETS)} replays)")


if __name__ == "__main__":
    main()
