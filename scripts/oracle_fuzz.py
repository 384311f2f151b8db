"""Random small traces through simkv and the real vLLM scheduler (../shared/tools/vllm_oracle):
every step's scheduled tokens, running and waiting requests and blocks in use, and every
request's first-token and finish time, must agree.

A development aid, not a test dependency (each oracle run takes about 10 s). Needs the oracle's venv:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_fuzz.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 20 [--async-scheduling]

Steps last 1 s on both sides (the oracle's time mode, simkv's linear model with no per-token
cost); arrivals fall between step boundaries. Pools are small, so requests are preempted, and
prompts may share content (block hashes). A case that differs is kept in --keep for a look.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from oracle_compare import _patched_oracle  # (scripts/ is on sys.path when run as a script)
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.traces.schema import read_trace, write_trace

ROOT = Path(__file__).resolve().parent.parent


def random_engine_options(rng: np.random.Generator, block_size: int, max_model_len: int) -> dict:
    """A small engine: pools, budgets and policies that preempt and share prefixes (also oracle_pd.py's)."""
    chunked = bool(rng.random() < 0.8)
    budget = int(rng.choice([32, 64, 128, 512]))
    if not chunked:
        budget = max(budget, max_model_len)
    max_num_seqs = int(rng.choice([2, 4, 8, 32]))
    return dict(block_size=block_size, max_model_len=max_model_len, max_num_batched_tokens=max(budget, max_num_seqs),
                max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
                num_gpu_blocks=int(max_model_len // block_size + 2 + rng.integers(0, 40)),
                enable_prefix_caching=bool(rng.random() < 0.8),
                watermark=float(rng.choice([0.0, 0.0, 0.05])),
                long_prefill_token_threshold=int(rng.choice([0, 0, 16])) if chunked else 0,
                scheduling_policy=str(rng.choice(["fcfs", "fcfs", "priority"])))


def make_case(rng: np.random.Generator) -> tuple[pd.DataFrame, dict]:
    block_size = int(rng.choice([4, 8, 16]))
    max_model_len = int(rng.choice([64, 128, 256]))
    n = int(rng.integers(3, 60))
    frame = pd.DataFrame({
        "arrival_time_s": np.sort(rng.integers(0, 40, n)) + 0.5,
        "prompt_tokens": rng.integers(1, max_model_len, n),
        "output_tokens": rng.integers(1, 60, n),
        "priority": rng.integers(0, 3, n),
    })
    if rng.random() < 0.5:  # shared prompt content: a few prefixes, 8-token hash blocks
        prefixes = [list(rng.integers(0, 4, 40)) for _ in range(3)]
        frame["block_hashes"] = [prefixes[int(rng.integers(0, 3))][:-(-p // 8)] for p in frame.prompt_tokens]
        frame["hash_block_tokens"] = 8
    opts = random_engine_options(rng, block_size, max_model_len)
    return frame, opts


def run_oracle(py: str, oracle: Path, trace: Path, opts: dict, prefix: Path, async_scheduling: bool) -> None:
    cmd = [py, str(oracle), "run", "--input", str(trace), "--out-prefix", str(prefix), "--arrival", "time",
           "--block-size", str(opts["block_size"]), "--num-gpu-blocks", str(opts["num_gpu_blocks"]),
           "--max-num-seqs", str(opts["max_num_seqs"]), "--max-num-batched-tokens", str(opts["max_num_batched_tokens"]),
           "--max-model-len", str(opts["max_model_len"]), "--no-count-cached-free",
           "--step-time-base-s", "1.0", "--step-time-per-token-s", "0", "--policy", opts["scheduling_policy"]]
    if not opts["enable_chunked_prefill"]:
        cmd.append("--no-enable-chunked-prefill")
    if not opts["enable_prefix_caching"]:
        cmd.append("--no-enable-prefix-caching")
    if opts["long_prefill_token_threshold"]:
        cmd += ["--long-prefill-token-threshold", str(opts["long_prefill_token_threshold"])]
    if opts["watermark"]:
        cmd += ["--watermark", str(opts["watermark"])]
    if async_scheduling:
        cmd.append("--async-scheduling")
    subprocess.run(cmd, check=True, capture_output=True)


def differences(prefix: Path, res) -> list[str]:
    out = []
    summary = json.loads(Path(f"{prefix}.summary.json").read_text())
    s = res.summary
    # Preemptions per request: the oracle's total counts those of executed steps only, and under
    # async scheduling a request can preempt itself in a step that then runs nothing.
    with open(f"{prefix}.requests.csv") as f:
        preemptions = sum(int(r["num_preemptions"]) for r in csv.DictReader(f))
    for name, theirs, ours in [("steps", summary["total_steps"], s["num_steps"]),
                               ("preemptions", preemptions, s["num_preemptions"]),
                               ("prefix hits", summary["prefix_cache"]["hits_all"], s["prefix_cache_hits_tokens"])]:
        if theirs != ours:
            out.append(f"{name}: vLLM {theirs}, simkv {ours}")
    # Per step: tokens scheduled, running, waiting, blocks in use after scheduling. (Not the
    # prefill/decode split: the oracle counts a one-token recompute chunk past the prompt as a
    # decode, simkv as prefill.)
    with open(f"{prefix}.steps.csv") as f:
        theirs = [(int(r["num_scheduled_tokens"]), int(r["num_running"]), int(r["num_waiting"]),
                   int(r["kv_blocks_used"])) for r in csv.DictReader(f)]
    st = res.steps
    ours = list(zip((st["num_prefill_tokens"] + st["num_decode_tokens"]).tolist(), st["num_running"].tolist(),
                    st["num_waiting"].tolist(), st["num_blocks_used"].tolist()))
    bad = [i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b]
    if bad or len(theirs) != len(ours):
        out.append(f"steps differ from step {bad[0] if bad else min(len(theirs), len(ours))}")
    with open(f"{prefix}.requests.csv") as f:
        theirs = {int(r["row"]): (r["first_token_time_s"], r["finish_time_s"]) for r in csv.DictReader(f)}
    req = res.requests
    for i, (a, b) in enumerate(zip(req["first_token_time_s"].tolist(), req["finish_time_s"].tolist())):
        t = theirs.get(i)
        if t is None or t[0] == "":
            continue  # rejected there
        if abs(float(t[0]) - a) > 1e-6 or abs(float(t[1]) - b) > 1e-6:
            out.append(f"request {i}: vLLM first token/finish {t}, simkv {a:.3f}/{b:.3f}")
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle-python", required=True)
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--keep", default="/tmp/oracle_fuzz_failures")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        oracle = _patched_oracle(tmp)
        for case in range(args.cases):
            frame, opts = make_case(rng)
            trace = tmp / f"case{case}.parquet"
            write_trace(frame, trace)
            try:
                config = EngineConfig.from_flat(opts | {"async_scheduling": args.async_scheduling})
            except ConfigError as exc:
                print(f"case {case}: skipped ({exc})")
                continue
            run_oracle(args.oracle_python, oracle, trace, opts, tmp / f"o{case}", args.async_scheduling)
            res = replay(read_trace(trace), config, "linear",
                         {"step_base_s": 1.0, "step_per_token_s": 0.0})
            diff = differences(tmp / f"o{case}", res)
            print(f"case {case}: {len(frame)} requests, {res.summary['num_steps']} steps, "
                  f"{res.summary['num_preemptions']} preemptions: " + ("equal" if not diff else "; ".join(diff)),
                  flush=True)
            if diff:
                failed += 1
                keep = Path(args.keep) / f"case{case}"
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(trace, keep)
                (keep / "options.json").write_text(json.dumps(opts, indent=1))
    print(f"{args.cases - failed} of {args.cases} cases equal")


if __name__ == "__main__":
    main()
