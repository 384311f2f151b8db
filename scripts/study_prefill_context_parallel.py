"""The prefill-context-parallelism study's table (docs/studies.md, "Long prompts on DeepSeek-V3:
prefill context parallelism or more tensor parallelism"), regenerated.

Replays the bundled Mooncake-shaped slice (1,000 requests, prompts p50 2.9k, p90 35k, up to 135k
tokens) at 1 and 2 requests/s with DeepSeek-V3, and at 2/s with DeepSeek-V3.2 (sparse attention;
its data-parallel layout left out), on H200s (roofline), on 8 GPUs (TP 8; TP 4 x PCP 2)
and on 16 (two TP 8 replicas behind a least-outstanding router; TP 8 with two data-parallel
ranks; TP 16; TP 8 x PP 2; TP 8 x PCP 2), the 16-GPU layouts over two 8-GPU nodes (50 GB/s a GPU between
them) and, for PCP, also inside one 16-GPU NVLink domain. Prints one markdown row per replay:
TTFT over all requests and over those with prompts of 32k tokens or more, TPOT, throughput.

    .venv/bin/python scripts/study_prefill_context_parallel.py
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.config import EngineConfig  # noqa: E402
from simkv.replay.api import FleetSpec, replay  # noqa: E402
from simkv.traces.schema import read_trace  # noqa: E402

V3 = {"model": "deepseek-v3", "gpu": "H200"}
SETUPS = [  # (GPUs, layout, engine options, replicas)
    (8, "TP 8", {"tensor_parallel_size": 8}, 1),
    (8, "TP 8, prefill rows split over TP (V3.2)", {"tensor_parallel_size": 8, "indexer_tp_shard_min_rows": 1024}, 1),
    (8, "TP 4 x PCP 2", {"tensor_parallel_size": 4, "prefill_context_parallel_size": 2}, 1),
    (16, "2 x TP 8 (replicas)", {"tensor_parallel_size": 8}, 2),
    (16, "DP 2 x TP 8", {"tensor_parallel_size": 8, "data_parallel_size": 2}, 1),
    (16, "TP 16 (two nodes)", {"tensor_parallel_size": 16}, 1),
    (16, "TP 8 x PP 2 (a stage a node)", {"tensor_parallel_size": 8, "pipeline_parallel_size": 2}, 1),
    (16, "TP 8 x PCP 2 (two nodes)", {"tensor_parallel_size": 8, "prefill_context_parallel_size": 2}, 1),
    (16, "TP 8 x PCP 2 (one NVLink domain)", {"tensor_parallel_size": 8, "prefill_context_parallel_size": 2,
                                              "gpus_per_node": 16}, 1),
]
LONG = 32_768  # prompts this long or longer: the "long prompts" columns


def _applies(model: str, options: dict) -> bool:
    """The indexer's prefill rows split over TP are V3.2's (it has the indexer); V3.2's DP ranks
    are the DeepSeek-V3.2 study's."""
    if "indexer_tp_shard_min_rows" in options:
        return model == "deepseek-v3.2"
    return model == "deepseek-v3" or "data_parallel_size" not in options


def main() -> None:
    base = read_trace(ROOT / "traces" / "mooncake_synthetic_slice.parquet")
    long = base.prompt_tokens >= LONG
    print(f"({int(long.sum())} of {len(base.prompt_tokens)} prompts have {LONG:,} tokens or more)")
    print("| model | rate | GPUs | layout | TTFT mean / p50 / p99 s | long prompts' TTFT p50 / p99 s | "
          "TPOT mean ms | output tok/s |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    span = float(base.arrival_time_s[-1] - base.arrival_time_s[0])
    for model, rate in (("deepseek-v3", 1.0), ("deepseek-v3", 2.0), ("deepseek-v3.2", 2.0)):
        factor = rate * span / (len(base.arrival_time_s) - 1)
        trace = replace(base, arrival_time_s=base.arrival_time_s / factor)
        for gpus, name, options, replicas in SETUPS:
            if not _applies(model, options):
                continue
            config = EngineConfig.from_flat(V3 | {"model": model} | options)
            fleet = FleetSpec(replicas, "least_outstanding") if replicas > 1 else None
            res = replay(trace, config, fleet=fleet)
            s, req = res.summary, res.requests
            ttft = req["ttft_s"].to_numpy()
            lt = ttft[long]
            print(f"| {model.removeprefix('deepseek-')} | {rate:g}/s | {gpus} | {name} | "
                  f"{s['ttft_s']['mean']:.2f} / {s['ttft_s']['p50']:.2f} / "
                  f"{s['ttft_s']['p99']:.2f} | {np.percentile(lt, 50):.2f} / {np.percentile(lt, 99):.2f} | "
                  f"{1e3 * s['tpot_s']['mean']:.1f} | {s['output_throughput_tok_s']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
