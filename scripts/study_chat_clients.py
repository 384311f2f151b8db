"""The chat-clients study's table (docs/studies.md, "How many chat clients one engine takes"),
regenerated.

Synthetic conversations (simkv trace synth multi-turn: 400 sessions of 8 turns, replies hashed so
the next turn finds them, all sessions ready at once, no think time) replayed on one H100 with
llama-3.1-8b under `client_max_concurrency` N: N clients that each send one turn at a time
(vLLM's multi-turn benchmark's --num-clients), with N conversations in progress (its default
--max-active-conversations, one per client: `client_max_active_sessions` N) or all of them (the
earliest due turn goes first). Prints one markdown row per setting.

    .venv/bin/python scripts/study_chat_clients.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.config import EngineConfig  # noqa: E402
from simkv.replay.api import replay  # noqa: E402
from simkv.traces.synth_sessions import SessionShape, multi_turn  # noqa: E402

CLIENTS = (8, 32, 64, 128, 256, 512)


def main() -> None:
    trace = multi_turn(SessionShape(sessions=400, turns=8, think_time_s=0.0), seed=20261206)
    print(f"{len(trace):,} turns, {int(trace.prompt_tokens.sum()):,} prompt tokens, "
          f"{int(trace.output_tokens.sum()):,} output tokens")
    print("| clients | active conversations | duration s | turns/s | output tok/s | TTFT p50 / p99 ms | "
          "ITL p50 / p99 ms | prefix hits | peak KV blocks | preemptions |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for n in CLIENTS:
        for active in (n, None):
            config = EngineConfig.from_flat(dict(model="llama-3.1-8b", gpu="H100-SXM", client_max_concurrency=n,
                                                 client_max_active_sessions=active))
            s = replay(trace, config).summary
            print(f"| {n:,} | {'all' if active is None else f'{active:,}'} | {s['duration_s']:,.1f} | "
                  f"{s['request_throughput_req_s']:.2f} | {s['output_throughput_tok_s']:,.0f} | "
                  f"{1e3 * s['ttft_s']['p50']:,.0f} / {1e3 * s['ttft_s']['p99']:,.0f} | "
                  f"{1e3 * s['itl_s']['p50']:.1f} / {1e3 * s['itl_s']['p99']:.1f} | "
                  f"{100 * s['prefix_cache_hit_rate']:.1f} % | {s['peak_blocks_used']:,} / {s['num_gpu_blocks']:,} | "
                  f"{s['num_preemptions']:,} |", flush=True)
    print(f"({time.perf_counter() - t0:.1f} s for {2 * len(CLIENTS)} replays)")


if __name__ == "__main__":
    main()
