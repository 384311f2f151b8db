"""The multi-turn offloading study's table (docs/studies.md, "vLLM's multi-turn benchmark and a CPU
tier"), regenerated.

vLLM's multi-turn benchmark (benchmarks/multi_turn) is its tool for KV offloading: clients that
each rotate over their own conversations, so a conversation's next turn comes back after the
client's other conversations had theirs. Here its example generator file, scaled to 600
conversations, replayed as the script runs it (`client_rotation`, its early stop and its 120 s
time-out) with 64 clients on one H100 (llama-3.1-8b, vLLM's defaults) for 64, 256 and all 600
conversations in progress (its --max-active-conversations), each with the GPU's prefix cache
alone and with a 64 GiB (LRU or ARC) or 256 GiB CPU tier (--kv-offloading-size,
--kv-offloading-policy). Prints one markdown row per setting.

    .venv/bin/python scripts/study_multi_turn_offload.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.config import EngineConfig  # noqa: E402
from simkv.replay.api import replay  # noqa: E402
from simkv.traces.vllm_multi_turn import multi_turn_trace, read_config  # noqa: E402

GENERATOR = {  # vLLM's generate_multi_turn.json, 600 conversations instead of 24
    "filetype": "generate_conversations", "num_conversations": 600, "text_files": ["pg1184.txt"],
    "prompt_input": {"num_turns": {"distribution": "uniform", "min": 12, "max": 18},
                     "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
                     "prefix_num_tokens": {"distribution": "lognormal", "average": 1000, "max": 5000},
                     "num_tokens": {"distribution": "uniform", "min": 120, "max": 160}},
    "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 80, "max": 120}},
}
CLIENTS = 64
ACTIVE = (64, 256, 600)
TIERS = (None, (64, "lru"), (64, "arc"), (256, "lru"))  # (GiB, the tier's eviction policy)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "generate_multi_turn.json"
        path.write_text(json.dumps(GENERATOR))
        trace = multi_turn_trace(read_config(path))
    print(f"{len(trace):,} turns, {int(trace.prompt_tokens.sum()):,} prompt tokens")
    print("| conversations in progress | CPU tier | requests counted | turns/s | TTFT p50 / p99 ms | "
          "prompt tokens from GPU cache | from CPU tier | peak KV blocks |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for active in ACTIVE:
        for tier in TIERS:
            options = dict(model="llama-3.1-8b", gpu="H100-SXM", client_max_concurrency=CLIENTS,
                           client_max_active_sessions=active, client_rotation=True, client_early_stop=True,
                           client_timeout_s=120.0)
            if tier is not None:
                options |= {"kv_offloading_size": tier[0], "kv_offloading_policy": tier[1]}
            result = replay(trace, EngineConfig.from_flat(options))
            s, requests = result.summary, result.requests
            done = requests[requests["status"] == "finished"]
            span = float(done["finish_time_s"].max() - done["arrival_time_s"].min())
            ttft = done["ttft_s"].quantile([0.5, 0.99]).to_numpy() * 1e3
            queried = s["prefix_cache_queries_tokens"]
            gpu_hits = 100 * s["prefix_cache_hits_tokens"] / queried if queried else 0.0
            cpu_hits = 100 * s["kv_offloading"]["hit_rate"] if "kv_offloading" in s else 0.0
            print(f"| {active:,} | {'none' if tier is None else f'{tier[0]} GiB {tier[1].upper()}'} | {len(done):,} | "
                  f"{len(done) / span:.2f} | {ttft[0]:,.0f} / {ttft[1]:,.0f} | {gpu_hits:.1f} % | "
                  f"{cpu_hits:.1f} % | {s['peak_blocks_used']:,} / {s['num_gpu_blocks']:,} |", flush=True)
    print(f"({time.perf_counter() - t0:.1f} s for {len(ACTIVE) * len(TIERS)} replays)")


if __name__ == "__main__":
    main()
