"""The multi-module MTP study's table (docs/studies.md, "Multi-module MTP: a module per draft"),
regenerated.

Replays the bundled Azure conversation slice (llama-3-8b on one H100, roofline) at 1x and 4x its
rate with MTP at K = 3: one module applied three times (vLLM's MTPSpeculator), and three modules,
one per draft (vLLM's MultiModuleMTPSpeculator: every module over the whole step, prefill chunks
keeping K tokens of runway), at conditional acceptance rates 0.7 (the same as one module's), 0.8
and 0.9 (the acceptance is an assumption: separate modules are trained for their position, so
later drafts are accepted more often; read yours off vLLM's logs). The modules are shaped like
the target's layers. Prints one markdown row per replay.

    .venv/bin/python scripts/study_multi_module_mtp.py
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

SETUPS = [("one module, acceptance 0.7", 1, 0.7)] + [
    (f"three modules, acceptance {rate}", 3, rate) for rate in (0.7, 0.8, 0.9)]


def main() -> None:
    base = read_trace(ROOT / "traces" / "azure_conv_slice.parquet")
    loads = {"1x": base, "4x": replace(base, arrival_time_s=base.arrival_time_s / 4.0)}
    print("| load | MTP, K = 3 | tokens per verify | drafter share | KV blocks | TPOT mean ms | ITL p50 / p99 ms | "
          "TTFT p50 / p99 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for load, trace in loads.items():
        for label, modules, rate in SETUPS:
            options = dict(speculative_method="mtp", num_speculative_tokens=3, spec_mtp_modules=modules,
                           spec_acceptance_rate=rate)
            s = replay(trace, EngineConfig.from_flat(options)).summary
            spec = s["speculative_decoding"]
            print(f"| {load} | {label} | {spec['mean_acceptance_length']:.2f} | {100 * spec['drafter_time_share']:.1f} % | "
                  f"{s['num_gpu_blocks']:,} | {1e3 * s['tpot_s']['mean']:.2f} | "
                  f"{1e3 * s['itl_s']['p50']:.1f} / {1e3 * s['itl_s']['p99']:.1f} | "
                  f"{1e3 * s['ttft_s']['p50']:.0f} / {1e3 * s['ttft_s']['p99']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
