"""The admission-limits study's table (docs/studies.md, "Which knob holds the queue"), regenerated.

Replays the bundled Azure conversation slice (llama-3-8b, roofline) at 6x its rate on one H100
with vLLM 0.33's defaults, then changes one setting at a time, and prints one markdown row per
replay: what held the waiting queue back (summary.json's `admission_limits`, shares of the
request-seconds spent waiting), TTFT and throughput.

    .venv/bin/python scripts/study_admission_limits.py
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.config import EngineConfig  # noqa: E402
from simkv.replay.api import replay  # noqa: E402
from simkv.traces.schema import read_trace  # noqa: E402

SETTINGS = (
    ("vLLM 0.33's defaults", {}),
    ("max_num_seqs 256", dict(max_num_seqs=256)),
    ("max_num_batched_tokens 2,048", dict(max_num_batched_tokens=2048)),
    ("kv_cache_dtype fp8", dict(kv_cache_dtype="fp8")),
    ("kv_cache_dtype int4_per_token_head", dict(kv_cache_dtype="int4_per_token_head")),
    ("gpu_memory_utilization 0.6", dict(gpu_memory_utilization=0.6)),
    ("H200 instead of H100", dict(gpu="H200")),
    ("max_num_seqs 256, H200", dict(max_num_seqs=256, gpu="H200")),
)


def held(summary: dict) -> str:
    limits = summary["admission_limits"]
    parts = [f"{name} {100 * v['share']:.0f} %" for name, v in limits["by_limit"].items() if v["share"] >= 0.005]
    return ", ".join(parts) or "nothing waited"


def main(factor: float = 6.0) -> None:
    base = read_trace(ROOT / "traces" / "azure_conv_slice.parquet")
    trace = replace(base, arrival_time_s=base.arrival_time_s / factor)
    print(f"Azure slice at {factor:g}x, llama-3-8b, one H100 unless said otherwise.\n")
    print("| setting | KV blocks | peak running | preemptions | waiting request-s | waiting held by "
          "(share of waiting time) | TTFT p50 / p99 s | TPOT mean ms | req/s |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for label, options in SETTINGS:
        s = replay(trace, EngineConfig.from_flat(options)).summary
        print(f"| {label} | {s['num_gpu_blocks']:,} | {s['peak_running']:,} | {s['num_preemptions']:,} | "
              f"{s['admission_limits']['waiting_request_s']:,.0f} | {held(s)} | "
              f"{s['ttft_s']['p50']:.2f} / {s['ttft_s']['p99']:.2f} | {1e3 * s['tpot_s']['mean']:.1f} | "
              f"{s['request_throughput_req_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 6.0)
