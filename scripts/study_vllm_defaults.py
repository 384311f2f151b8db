"""The defaults study's table (docs/studies.md, "Batch defaults: vLLM 0.33's by GPU, or 256 and 8,192
everywhere"), regenerated.

Replays the bundled Azure conversation slice (llama-3-8b, roofline) at 1x, 4x, 6x and 8x its rate
on one H100, one L40S and one B200, each with fixed batch defaults (max_num_seqs 256,
max_num_batched_tokens 8,192 on every GPU: simkv's defaults before 2026-12-06,
--no-vllm-batch-defaults) and with vLLM 0.33's API-server defaults on that GPU (simkv's defaults
now, config.vllm_batch_defaults). Prints one markdown row per replay.

    .venv/bin/python scripts/study_vllm_defaults.py
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


def main() -> None:
    base = read_trace(ROOT / "traces" / "azure_conv_slice.parquet")
    print("| GPU | load | defaults | max_num_seqs / max_num_batched_tokens | peak running | preemptions | "
          "TTFT p50 / p99 ms | TPOT mean ms | ITL p99 ms |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for gpu in ("H100-SXM", "L40S", "B200"):
        for factor in (1, 4, 6, 8):
            trace = replace(base, arrival_time_s=base.arrival_time_s / factor)
            for label, options in (("fixed", dict(vllm_batch_defaults=False)), ("vLLM's", {})):
                config = EngineConfig.from_flat(dict(gpu=gpu) | options)
                s = replay(trace, config).summary
                sc = config.scheduler
                print(f"| {gpu} | {factor}x | {label} | {sc.max_num_seqs:,} / {sc.max_num_batched_tokens:,} | "
                      f"{s['peak_running']:,} | {s['num_preemptions']:,} | "
                      f"{1e3 * s['ttft_s']['p50']:,.0f} / {1e3 * s['ttft_s']['p99']:,.0f} | "
                      f"{1e3 * s['tpot_s']['mean']:.2f} | {1e3 * s['itl_s']['p99']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
