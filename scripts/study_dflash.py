"""The DFlash study's table (docs/studies.md, "DFlash: sixteen tokens a pass"), regenerated.

Replays the bundled Azure conversation slice (llama-3-8b on one H100, roofline) at 1x and 4x its
rate: without speculation, EAGLE-3 at K = 3 (per-position rates 0.8 / 0.6 / 0.45, the
speculative-decoding study's), and vLLM's dflash drafter (five target-shaped layers) at K = 15
and K = 7 with conditional acceptance rates 0.7, 0.8 and 0.87 (the acceptance is an assumption:
read yours off vLLM's logs), and K = 15 cut by the step's batch size (vLLM's
num_speculative_tokens_per_batch_size); at 4x also with max_num_batched_tokens 2,048, where K = 15 caps the
running requests at 128. Prints one markdown row per replay.

    .venv/bin/python scripts/study_dflash.py
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

EAGLE3 = dict(speculative_method="eagle3", num_speculative_tokens=3, spec_position_acceptance_rates="0.8,0.6,0.45")


def setups(load: str):
    """(label, options) in the table's order."""
    yield "no speculation", {}
    yield "EAGLE-3, K = 3", EAGLE3
    for k, rate in ((15, 0.7), (15, 0.8), (15, 0.87), (7, 0.8)):
        yield f"dflash, K = {k}, acceptance {rate}", dict(speculative_method="dflash", num_speculative_tokens=k,
                                                          spec_acceptance_rate=rate)
    yield "dflash, K by batch (15 up to 16 requests, 7 up to 64, then 3), acceptance 0.8", dict(
        speculative_method="dflash", num_speculative_tokens=15, spec_acceptance_rate=0.8,
        spec_tokens_per_batch_size="1-16:15,17-64:7,65-1024:3")
    if load == "4x":
        yield "dflash, K = 15, acceptance 0.8, max_num_batched_tokens 2,048", dict(
            speculative_method="dflash", num_speculative_tokens=15, spec_acceptance_rate=0.8,
            max_num_batched_tokens=2048)


def main() -> None:
    base = read_trace(ROOT / "traces" / "azure_conv_slice.parquet")
    loads = {"1x": base, "4x": replace(base, arrival_time_s=base.arrival_time_s / 4.0)}
    print("| load | setup | tokens per verify | drafter share | KV blocks | mean running | TPOT mean ms | "
          "ITL p50 / p99 ms | TTFT p50 / p99 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for load, trace in loads.items():
        for label, options in setups(load):
            s = replay(trace, EngineConfig.from_flat(options)).summary
            spec = s.get("speculative_decoding")
            length = f"{spec['mean_acceptance_length']:.2f}" if spec else "1"
            share = f"{100 * spec['drafter_time_share']:.1f} %" if spec else "-"
            print(f"| {load} | {label} | {length} | {share} | {s['num_gpu_blocks']:,} | {s['mean_running']:.1f} | "
                  f"{1e3 * s['tpot_s']['mean']:.2f} | {1e3 * s['itl_s']['p50']:.1f} / {1e3 * s['itl_s']['p99']:.1f} | "
                  f"{1e3 * s['ttft_s']['p50']:.0f} / {1e3 * s['ttft_s']['p99']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
