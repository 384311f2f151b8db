"""The speculative-decoding study's latency table (docs/studies.md), regenerated.

Replays the bundled Azure conversation slice (llama-3-8b on one H100, roofline) at a few load
multiples, with no speculation, an ngram drafter and EAGLE-3, synchronously and under async
scheduling, and prints one markdown row per replay. `--misses`: the n-gram misses table instead,
the same mean gain (0.42 accepted drafts per verifying step) as a low acceptance rate at every
step, or as a match at 27 % of the steps accepted at 0.7, on vLLM's V2 model runner (its default:
a miss still verifies K drafts) and on its V1 runner (a miss proposes none).

    .venv/bin/python scripts/study_speculative.py [--loads 1,2,4,6] [--modes sync,async] [--misses]
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


NGRAM = ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]
MISSES = {  # (label, options): the same mean gain, 0.42 accepted drafts per verifying step
    "every step 3 drafts, acceptance 0.3": NGRAM + ["--spec-acceptance-rate", "0.3"],
    "a match at 27 % of steps, acceptance 0.7; V2 runner": NGRAM + ["--spec-ngram-match-rate", "0.27",
                                                                     "--spec-acceptance-rate", "0.7"],
    "same, V2 runner, async scheduling": NGRAM + ["--spec-ngram-match-rate", "0.27", "--spec-acceptance-rate", "0.7",
                                                  "--async-scheduling"],
    "same, V1 runner (no drafts after a miss)": NGRAM + ["--spec-ngram-match-rate", "0.27",
                                                         "--spec-acceptance-rate", "0.7", "--model-runner", "v1"],
}


def misses_table(loads: list[str], tmp: Path) -> None:
    print("| load | ngram modelled as | mean acceptance length (vLLM's) | draft tokens | mean running "
          "| TPOT p50 / p99 ms | ITL p50 / p99 ms | TTFT p50 / p99 ms | output tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for load in loads:
        trace = scaled_trace(tmp, load)
        for label, options in MISSES.items():
            summary = replay_summary(trace, options, tmp)
            spec = summary["speculative_decoding"]
            cells = row(summary)
            print("| " + " | ".join([f"{load}x", label, f"{spec['mean_acceptance_length']:.2f}",
                                     f"{spec['num_draft_tokens']:,}"] + cells[:5]) + " |", flush=True)


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
    ap.add_argument("--misses", action="store_true", help="the n-gram misses table (--loads 1,4,6 in the docs)")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if a.misses:
        with tempfile.TemporaryDirectory() as tmp:
            misses_table(a.loads.split(","), Path(tmp))
        return
    print("| load | setup | scheduling | mean running | TPOT p50 / p99 ms | ITL p50 / p99 ms "
          "| TTFT p50 / p99 ms | output tok/s | drafter share |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for load in a.loads.split(","):
            trace = scaled_trace(Path(tmp), load)
            for name, options in SETUPS.items():
                for mode in modes:  # (ngram under async scheduling: vLLM's V2 runner drafts it on the device)
                    extra = ["--async-scheduling"] if mode == "async" else []
                    summary = replay_summary(trace, options + extra, Path(tmp))
                    print("| " + " | ".join([f"{load}x", name, mode] + row(summary)) + " |", flush=True)


if __name__ == "__main__":
    main()
