"""The hybrid-model speculative-decoding table of docs/studies.md, regenerated: what drafts cost a
model with linear-attention layers, whose every Mamba group holds 1 + K state blocks a request.

Replays the bundled Azure conversation slice on Qwen3-Next-80B-A3B (two H200s, TP 2, roofline)
at a few load multiples, with no speculation, ngram (K = 3) and suffix decoding at vLLM's default
K = 24 and capped at K = 8, and prints one markdown row per replay. The drafters' rates are the
speculative study's (assumptions, not measurements).

    .venv/bin/python scripts/study_hybrid_suffix.py [--loads 1,4,8,12] [--model M] [-tp N] [--gpu G]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from study_runs import replay_summary, scaled_trace  # (scripts/ is on sys.path when run as a script)

MATCH = ["--spec-ngram-match-rate", "0.27"]
DRAFTERS = {
    "none": [],
    "ngram, K = 3": ["--speculative-method", "ngram", "--num-speculative-tokens", "3", *MATCH,
                     "--spec-acceptance-rate", "0.7"],
    "suffix, K = 24": ["--speculative-method", "suffix", *MATCH, "--spec-mean-draft-tokens", "6",
                       "--spec-acceptance-rate", "0.85"],
    "suffix, K = 8": ["--speculative-method", "suffix", "--num-speculative-tokens", "8", *MATCH,
                      "--spec-mean-draft-tokens", "4.5", "--spec-acceptance-rate", "0.85"],
}


def row(summary: dict) -> list[str]:
    ms = lambda key: f"{summary[key]['p50'] * 1e3:,.1f} / {summary[key]['p99'] * 1e3:,.1f}"  # noqa: E731
    spec = summary.get("speculative_decoding")
    linear = summary["kv_cache_groups"]["linear_attention"]
    return [str(summary["config"]["block_size"]), f"{summary['num_gpu_blocks']:,}",
            str(linear["state_blocks_per_request"]),
            f"{spec['mean_acceptance_length']:.2f}" if spec else "1.00",
            f"{summary['mean_running']:.1f} / {summary['peak_running']}", ms("tpot_s"), ms("ttft_s"),
            f"{summary['output_throughput_tok_s']:,.0f}", str(summary["num_preemptions"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="1,4,8,12")
    ap.add_argument("--model", default="qwen3-next-80b-a3b")
    ap.add_argument("-tp", "--tensor-parallel-size", default="2")
    ap.add_argument("--gpu", default="H200")
    a = ap.parse_args()
    engine = ["--model", a.model, "-tp", a.tensor_parallel_size, "--gpu", a.gpu]
    print("| load | drafter | block size | KV blocks | state blocks a request | tokens per verify "
          "| mean / peak running | TPOT p50 / p99 ms | TTFT p50 / p99 ms | output tok/s | preemptions |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for load in a.loads.split(","):
            trace = scaled_trace(Path(tmp), load)
            for name, options in DRAFTERS.items():
                summary = replay_summary(trace, engine + options, Path(tmp))
                print("| " + " | ".join([f"{load}x" if name == "none" else "", name] + row(summary)) + " |")


if __name__ == "__main__":
    main()
