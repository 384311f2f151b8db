"""The expert-exchange study's table (docs/studies.md, "DeepSeek-V3 on two nodes: how the expert
layers exchange tokens (-ep, --all2all-backend, --enable-dbo)"), regenerated.

Replays the bundled Azure conversation slice at 10x its rate (decode-heavy) and the Mooncake-shaped
slice at 2 requests/s (long prompts) with DeepSeek-V3 on 16 H200s, two nodes of 8 with 50 GB/s a
GPU between them (roofline): two TP 8 replicas; 16 data-parallel ranks and DP 2 x TP 8, each with
vLLM's default exchange (allgather_reducescatter), with expert parallelism and DeepEP's
low-latency all-to-all at vLLM's token budget for it (256) and at the H200's usual 8,192, and with
dual batch overlap on top. Prints one markdown row per replay.

    .venv/bin/python scripts/study_expert_exchange.py
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.config import EngineConfig  # noqa: E402
from simkv.replay.api import FleetSpec, replay  # noqa: E402
from simkv.traces.schema import read_trace  # noqa: E402

V3 = {"model": "deepseek-v3", "gpu": "H200"}
DEEPEP = {"enable_expert_parallel": True, "all2all_backend": "deepep_low_latency"}
BUDGET = {"max_num_batched_tokens": 8192}  # (the H200's budget otherwise: vLLM gives DeepEP low-latency ranks 256)
SETUPS = [  # (layout, exchange, engine options, replicas)
    ("2 x TP 8 (replicas)", "-", {"tensor_parallel_size": 8}, 2),
]
for _layout, _ranks in (("DP 16", {"data_parallel_size": 16}),
                        ("DP 2 x TP 8", {"data_parallel_size": 2, "tensor_parallel_size": 8})):
    SETUPS += [
        (_layout, "gathered (vLLM's default)", _ranks, 1),
        (_layout, "DeepEP, vLLM's 256-token budget", _ranks | DEEPEP, 1),
        (_layout, "DeepEP, 8,192-token budget", _ranks | DEEPEP | BUDGET, 1),
        (_layout, "DeepEP + DBO, 8,192 tokens", _ranks | DEEPEP | BUDGET | {"enable_dbo": True}, 1),
    ]


def main() -> None:
    azure = read_trace(ROOT / "traces" / "azure_conv_slice.parquet")
    mooncake = read_trace(ROOT / "traces" / "mooncake_synthetic_slice.parquet")
    span = float(mooncake.arrival_time_s[-1] - mooncake.arrival_time_s[0])
    traces = [("Azure slice, 10x", replace(azure, arrival_time_s=azure.arrival_time_s / 10)),
              ("Mooncake slice, 2/s", replace(mooncake, arrival_time_s=mooncake.arrival_time_s
                                              / (2.0 * span / (len(mooncake.arrival_time_s) - 1))))]
    print("| trace | layout (16 H200s) | expert exchange | req/s | TTFT mean / p99 s | TPOT mean / p99 ms |")
    print("|---|---|---|---:|---:|---:|")
    for label, trace in traces:
        for layout, exchange, options, replicas in SETUPS:
            config = EngineConfig.from_flat(V3 | options)
            fleet = FleetSpec(replicas, "least_outstanding") if replicas > 1 else None
            s = replay(trace, config, fleet=fleet).summary
            print(f"| {label} | {layout} | {exchange} | {s['request_throughput_req_s']:.2f} | "
                  f"{s['ttft_s']['mean']:.2f} / {s['ttft_s']['p99']:.2f} | "
                  f"{1e3 * s['tpot_s']['mean']:.1f} / {1e3 * s['tpot_s']['p99']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
