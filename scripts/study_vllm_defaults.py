"""The defaults study's table (docs/studies.md, "simkv's defaults against vLLM 0.33's"), regenerated.

Replays the bundled Azure conversation slice (llama-3-8b, roofline) at 1x, 4x, 6x and 8x its rate
on one H100, one L40S and one B200, each with simkv's defaults (max_num_seqs 256,
max_num_batched_tokens 8,192) and with vLLM 0.33's API-server defaults on that GPU
(config.vllm_batch_defaults). Prints one markdown row per replay.

    .venv/bin/python scripts/study_vllm_defaults.py
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.config import EngineConfig, vllm_batch_defaults  # noqa: E402
from simkv.replay.api import replay  # noqa: E402
from simkv.traces.schema import read_trace  # noqa: E402


def main() -> None:
    base = read_trace(ROOT / "traces" / "azure_conv_slice.parquet")
    print("| GPU | load | defaults | max_num_seqs / max_num_batched_tokens | peak running | preemptions | "
          "TTFT p50 / p99 ms | TPOT mean ms | ITL p99 ms |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for gpu in ("H100-SXM", "L40S", "B200"):
        tokens, seqs = vllm_batch_defaults(gpu, EngineConfig.from_flat(dict(gpu=gpu)).max_model_len)
        for factor in (1, 4, 6, 8):
            trace = replace(base, arrival_time_s=base.arrival_time_s / factor)
            for label, options in (("simkv's", {}), ("vLLM's", dict(max_num_seqs=seqs, max_num_batched_tokens=tokens))):
                config = EngineConfig.from_flat(dict(gpu=gpu) | options)
                s = replay(trace, config).summary
                sc = config.scheduler
                print(f"| {gpu} | {factor}x | {label} | {sc.max_num_seqs:,} / {sc.max_num_batched_tokens:,} | "
                      f"{s['peak_running']:,} | {s['num_preemptions']:,} | "
                      f"{1e3 * s['ttft_s']['p50']:,.0f} / {1e3 * s['ttft_s']['p99']:,.0f} | "
                      f"{1e3 * s['tpot_s']['mean']:.2f} | {1e3 * s['itl_s']['p99']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
