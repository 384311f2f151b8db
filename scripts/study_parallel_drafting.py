"""The parallel-drafting study's table (docs/studies.md, "Drafting in parallel"), regenerated.

Replays the bundled Azure conversation slice (llama-3-8b on one H100, roofline) at 1x and 4x its
rate with EAGLE-3 at K = 3, 5 and 7, drafting in turn (K draft passes) and in parallel (vLLM's
parallel_drafting, P-EAGLE: one pass), at a conditional acceptance of 0.7 for both; then the
parallel drafter at K = 5 with lower acceptance (0.6, 0.5), since a drafter trained to draft in
parallel may be accepted less often. Prints one markdown row per replay.

    .venv/bin/python scripts/study_parallel_drafting.py
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


def setups():
    """(K, drafting label, options) in the table's order."""
    yield 0, "-", {}
    for k in (3, 5, 7):
        for parallel in (False, True):
            yield k, "parallel" if parallel else "in turn", dict(
                speculative_method="eagle3", num_speculative_tokens=k, spec_acceptance_rate=0.7,
                spec_parallel_drafting=parallel)
    for rate in (0.6, 0.5):
        yield 5, f"parallel, acceptance {rate}", dict(
            speculative_method="eagle3", num_speculative_tokens=5, spec_acceptance_rate=rate,
            spec_parallel_drafting=True)


def main() -> None:
    base = read_trace(ROOT / "traces" / "azure_conv_slice.parquet")
    loads = {"1x": base, "4x": replace(base, arrival_time_s=base.arrival_time_s / 4.0)}
    print("| load | K | drafting | tokens per verify | drafter share | TPOT mean ms | ITL p50 / p99 ms | TTFT p99 ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for load, trace in loads.items():
        for k, label, options in setups():
            s = replay(trace, EngineConfig.from_flat(options)).summary
            spec = s.get("speculative_decoding")
            length = f"{spec['mean_acceptance_length']:.2f}" if spec else "1"
            share = f"{100 * spec['drafter_time_share']:.1f} %" if spec else "-"
            print(f"| {load} | {k or '-'} | {label} | {length} | {share} | {1e3 * s['tpot_s']['mean']:.2f} | "
                  f"{1e3 * s['itl_s']['p50']:.1f} / {1e3 * s['itl_s']['p99']:.1f} | {1e3 * s['ttft_s']['p99']:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
