"""Compare simkv with the real vLLM scheduler (../shared/tools/vllm_oracle) on several scenarios.

A development aid, not a test dependency. Needs the oracle's venv:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_compare.py --oracle-python /tmp/vllm-oracle-venv/bin/python --out docs/vllm_comparison.md
Each scenario runs the oracle (about a minute each) and simkv on the same trace and flags, and
the table lists both values of every compared metric.

With `--async-scheduling` (and e.g. `--out docs/vllm_comparison_async.md`) both run vLLM's async
scheduling. In time mode the oracle, as shipped, lets a step see the requests that arrived by its
own start; vLLM's EngineCore schedules a step while the one before it runs, so it sees the
arrivals up to that step's start. The script runs a copy of the oracle with that one line
changed (`_patched_oracle`), which is what simkv models.
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

from simkv.config import EngineConfig
from simkv.replay.api import replay
from simkv.traces.schema import read_trace, trace_to_frame, write_trace

ROOT = Path(__file__).resolve().parent.parent
ORACLE = ROOT.parent / "shared" / "tools" / "vllm_oracle" / "oracle.py"
BASE = dict(block_size=16, num_gpu_blocks=6250, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
LINEAR = dict(step_base_s=0.015, step_per_token_s=2e-5)


def _with_priorities(src: Path, dst: Path) -> Path:
    frame = trace_to_frame(read_trace(src))
    frame["priority"] = np.random.default_rng(7).integers(0, 4, len(frame))
    write_trace(frame, dst)
    return dst


def scenarios(tmp: Path) -> list[dict]:
    t = ROOT / "traces"
    head = tmp / "azure300.parquet"
    frame = trace_to_frame(read_trace(t / "azure_conv_slice.parquet")).head(300)
    write_trace(frame, head)
    return [
        dict(name="req400, budget 1024, long_prefill_token_threshold 256", trace=t / "req400.parquet",
             opts=BASE | dict(max_num_batched_tokens=1024, long_prefill_token_threshold=256)),
        dict(name="req400, chunked prefill off", trace=t / "req400.parquet",
             opts=BASE | dict(enable_chunked_prefill=False)),
        dict(name="req400, priority policy (random priorities 0-3)",
             trace=_with_priorities(t / "req400.parquet", tmp / "req400_prio.parquet"),
             opts=BASE | dict(scheduling_policy="priority")),
        dict(name="req400, block size 32, 3125 blocks", trace=t / "req400.parquet",
             opts=BASE | dict(block_size=32, num_gpu_blocks=3125)),
        dict(name="req400 + 10 prefix groups, watermark 0.05", trace=t / "req400_prefix10.parquet",
             opts=BASE | dict(watermark=0.05)),
        dict(name="Azure conv first 300 requests, time mode, 600 blocks, max_model_len 8192", trace=head, time=True,
             opts=BASE | dict(num_gpu_blocks=600, max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=8192)),
        dict(name="kv-cache-tester coding sample, time mode, 10000 blocks", trace=t / "kvcache_coding_sample.parquet",
             time=True, opts=BASE | dict(num_gpu_blocks=10000, max_model_len=131072, max_num_batched_tokens=16384)),
        dict(name="Mooncake slice (first 200), time mode, 9000 blocks", trace=tmp / "mooncake200.parquet", time=True,
             opts=BASE | dict(num_gpu_blocks=9000, max_model_len=131072, max_num_batched_tokens=16384),
             make=lambda p: write_trace(trace_to_frame(read_trace(t / "mooncake_synthetic_slice.parquet")).head(200), p)),
    ]


def _patched_oracle(tmp: Path) -> Path:
    """A copy of the oracle whose async time mode admits arrivals by the start of the step in flight."""
    folder = tmp / "oracle"
    shutil.copytree(ORACLE.parent, folder)
    path = folder / "oracle.py"
    patch_once(path, "the arrival line",
               "            due = tr[key] <= (clock + 1e-12 if time_mode else step)",
               "            now = clock\n"
               "            if time_mode and batch_queue and batch_queue[0][2] is not None:\n"
               "                now = batch_queue[0][2][\"time_s\"]  # scheduled while the step in flight runs\n"
               "            due = tr[key] <= (now + 1e-12 if time_mode else step)")
    return path


def patch_once(path: Path, what: str, old: str, new: str) -> None:
    """Replace the one occurrence of `old` in the oracle copy at `path` (it must be there once)."""
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: {what} to patch was not found; the oracle changed")
    path.write_text(text.replace(old, new))


def run_oracle(py: str, sc: dict, prefix: Path, oracle: Path = ORACLE) -> dict:
    o = sc["opts"]
    cmd = [py, str(oracle), "run", "--input", str(sc["trace"]), "--out-prefix", str(prefix),
           "--block-size", str(o["block_size"]), "--num-gpu-blocks", str(o["num_gpu_blocks"]),
           "--max-num-seqs", str(o["max_num_seqs"]), "--max-num-batched-tokens", str(o["max_num_batched_tokens"]),
           "--max-model-len", str(o["max_model_len"]), "--no-count-cached-free"]
    if not o.get("enable_chunked_prefill", True):
        cmd.append("--no-enable-chunked-prefill")
    if o.get("long_prefill_token_threshold"):
        cmd += ["--long-prefill-token-threshold", str(o["long_prefill_token_threshold"])]
    if o.get("watermark"):
        cmd += ["--watermark", str(o["watermark"])]
    if o.get("scheduling_policy") == "priority":
        cmd += ["--policy", "priority"]
    if o.get("async_scheduling"):
        cmd.append("--async-scheduling")
    if sc.get("time"):
        cmd += ["--step-time-base-s", str(LINEAR["step_base_s"]), "--step-time-per-token-s", str(LINEAR["step_per_token_s"])]
    subprocess.run(cmd, check=True, capture_output=True)
    summary = json.loads(Path(f"{prefix}.summary.json").read_text())
    summary["prefix"] = str(prefix)
    return summary


def _step_by_step(oracle: dict, res) -> list[tuple]:
    """Step mode (all requests at step 0, unit steps of 1 s): every step's tokens and every
    request's first-token and finish step, as counts of those that differ."""
    with open(f"{oracle['prefix']}.steps.csv") as f:
        theirs = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    ours = list(zip(res.steps["num_prefill_tokens"].tolist(), res.steps["num_decode_tokens"].tolist()))
    steps_differ = sum(a != b for a, b in zip(theirs, ours)) + abs(len(theirs) - len(ours))
    with open(f"{oracle['prefix']}.requests.csv") as f:
        theirs = {int(r["row"]): (int(r["first_token_step"]), int(r["finish_step"])) for r in csv.DictReader(f)}
    req = res.requests
    ours = {i: (round(a) - 1, round(b) - 1) for i, (a, b) in
            enumerate(zip(req["first_token_time_s"].tolist(), req["finish_time_s"].tolist()))}
    requests_differ = sum(theirs.get(i) != ours[i] for i in ours)
    return [("steps whose prefill or decode tokens differ", 0, steps_differ),
            ("requests whose first-token or finish step differs", 0, requests_differ)]


def compare(sc: dict, oracle: dict) -> list[tuple]:
    config = EngineConfig.from_flat(sc["opts"])
    timed = bool(sc.get("time"))
    res = replay(read_trace(sc["trace"]), config, "linear" if timed else "unit", LINEAR)
    s = res.summary
    rows = [
        ("steps", oracle["total_steps"], s["num_steps"]),
        ("peak running", oracle["peak_running"], s["peak_running"]),
        ("preemptions", oracle["total_preemptions"], s["num_preemptions"]),
        ("requests preempted", oracle["requests_preempted_at_least_once"], s["num_preempted_requests"]),
        ("prefix hit tokens", oracle["prefix_cache"]["hits_all"], s["prefix_cache_hits_tokens"]),
        ("prefix queried tokens", oracle["prefix_cache"]["queries_all"], s["prefix_cache_queries_tokens"]),
        ("prefill tokens", oracle["total_prefill_tokens"], s["num_prefill_tokens"]),
        ("decode tokens", oracle["total_decode_tokens"], s["num_decode_tokens"]),
    ]
    if timed:
        for key in ("ttft_s", "e2e_s"):
            for q in ("mean", "p50", "p99"):
                rows.append((f"{key} {q}", round(oracle[key][q], 6), round(s[key][q], 6)))
        rows.append(("duration_s", round(oracle["duration_s"], 6), round(s["duration_s"], 6)))
    else:
        rows += _step_by_step(oracle, res)
    return rows


def _same(name: str, a, b) -> bool:
    """Counts must be equal; times (seconds, rounded to 6 decimals) within 1 us: two sums that
    differ in their last bits (simkv's clock counts ticks of 2**-40 s, the oracle adds floats)
    can round to neighbouring microseconds."""
    if name.endswith(("_s", "_s mean", "_s p50", "_s p99")):
        return abs(a - b) <= 1.000001e-6
    return a == b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle-python", required=True)
    ap.add_argument("--out", default="docs/vllm_comparison.md")
    ap.add_argument("--async-scheduling", action="store_true", help="both sides schedule asynchronously")
    args = ap.parse_args()
    title = "# simkv versus the real vLLM 0.33 scheduler" + (", async scheduling" if args.async_scheduling else "")
    lines = [title, "",
             "Made by `scripts/oracle_compare.py` (see its docstring for the command). Step-mode scenarios use simkv's",
             "`unit` cost model; time-mode scenarios use `linear` with the oracle's step time",
             f"({LINEAR['step_base_s']} s + {LINEAR['step_per_token_s']} s per scheduled token). Times, rounded",
             "to 6 decimals, count as the same within 1 us (simkv's clock counts ticks of 2**-40 s, the oracle",
             "adds floats: their sums can round to neighbouring microseconds).", ""]
    all_match = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        oracle_path = _patched_oracle(tmp) if args.async_scheduling else ORACLE
        for i, sc in enumerate(scenarios(tmp)):
            if "make" in sc:
                sc["make"](sc["trace"])
            if args.async_scheduling:
                sc["opts"] = sc["opts"] | dict(async_scheduling=True)
            oracle = run_oracle(args.oracle_python, sc, tmp / f"o{i}", oracle_path)
            rows = compare(sc, oracle)
            lines += [f"## {sc['name']}", "", "| metric | vLLM | simkv | same |", "|---|---|---|---|"]
            for name, a, b in rows:
                same = _same(name, a, b)
                all_match &= same
                lines.append(f"| {name} | {a} | {b} | {'yes' if same else '**no**'} |")
            lines.append("")
            print(sc["name"], "all equal" if all(_same(*row) for row in rows) else "DIFFERENCES", flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("wrote", args.out, "(every value equal)" if all_match else "(some values differ)")


if __name__ == "__main__":
    main()
