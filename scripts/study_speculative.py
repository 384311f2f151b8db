"""The speculative-decoding study's latency table (docs/studies.md), regenerated.

Replays the bundled Azure conversation slice (llama-3-8b on one H100, roofline) at a few load
multiples, with no speculation, an ngram drafter and EAGLE-3, synchronously and (where vLLM runs
it: not the CPU n-gram drafter) under async scheduling, and prints one markdown row per replay.

    .venv/bin/python scripts/study_speculative.py [--loads 1,2,4,6] [--modes sync,async]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from study_runs import replay_summary, scaled_trace  # (scripts/ is on sys.path when run as a script)

SETUPS = {
    "no speculation": [],
    "ngram": ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--spec-acceptance-rate", "0.3"],
    "EAGLE-3": ["--speculative-method", "eagle3", "--num-speculative-tokens", "3",
                "--spec-position-acceptance-rates", "0.8,0.6,0.45"],
}


def row(summary: dict) -> list[str]:
    ms = lambda key: f"{summary[key]['p50'] * 1e3:.1f} / {summary[key]['p99'] * 1e3:.1f}"  # noqa: E731
    spec = summary.get("speculative_decoding")
    share = f"{spec['drafter_time_share'] * 100:.1f} %" if spec else "-"
    ttft = f"{summary['ttft_s']['p50'] * 1e3:,.0f} / {summary['ttft_s']['p99'] * 1e3:,.0f}"
    return [f"{summary['mean_running']:.1f}", ms("tpot_s"), ms("itl_s"), ttft,
            f"{summary['output_throughput_tok_s']:,.0f}", share]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="1,2,4,6")
    ap.add_argument("--modes", default="sync,async")
    a = ap.parse_args()
    modes = a.modes.split(",")
    print("| load | setup | scheduling | mean running | TPOT p50 / p99 ms | ITL p50 / p99 ms "
          "| TTFT p50 / p99 ms | output tok/s | drafter share |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for load in a.loads.split(","):
            trace = scaled_trace(Path(tmp), load)
            for name, options in SETUPS.items():
                for mode in modes:
                    if mode == "async" and name == "ngram":
                        continue  # vLLM refuses async scheduling with its CPU n-gram drafter
                    extra = ["--async-scheduling"] if mode == "async" else []
                    summary = replay_summary(trace, options + extra, Path(tmp))
                    print("| " + " | ".join([f"{load}x", name, mode] + row(summary)) + " |", flush=True)


if __name__ == "__main__":
    main()
