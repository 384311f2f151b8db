"""Random small traces through simkv and the real vLLM scheduler (../shared/tools/vllm_oracle):
every step's scheduled tokens, running and waiting requests and blocks in use, and every
request's first-token and finish time, must agree.

A development aid, not a test dependency (each oracle run takes about 10 s). Needs the oracle's venv:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_fuzz.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 20 [--async-scheduling]
        [--replies] [--lora]

--replies: chat sessions whose next turn's prompt repeats the previous turn's reply, with hash
lists that describe the replies; the oracle's fake model then samples the reply's content tokens,
so vLLM caches the reply's blocks under the keys the next turn's prompt has. Each turn arrives
after its previous turn finished (arrivals are pushed later until simkv's replay says so, and
the oracle's run is checked for it too), as a client that sends the reply back does. (simkv makes
a reply's blocks findable by others when its request releases them, vLLM as they fill: the same
hits wherever no prompt repeats a reply still being written.)

--lora: requests name LoRA adapters (some the base model); vLLM's scheduler runs with a LoRA
config of max_loras 1-3 (the oracle copy is given one, and LoRARequests with the names), so a
waiting request whose adapter would exceed max_loras is passed over, and block hashes carry the
adapter's name (prompts share cached blocks under one adapter only).

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

from oracle_compare import _patched_oracle, patch_once  # (scripts/ is on sys.path when run as a script)
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.traces.schema import read_trace, trace_from_frame, write_trace

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


def make_reply_case(rng: np.random.Generator) -> tuple[pd.DataFrame, dict]:
    """Chat sessions: turn k's prompt = turn k-1's prompt + its reply + new user tokens; each
    session one stream of hash ids (a few share a first block, a system prompt). Most rows
    describe their reply too; some only their prompt."""
    block_size = int(rng.choice([4, 8, 16]))
    max_model_len = int(rng.choice([128, 256]))
    h = int(rng.choice([4, 8]))
    rows = []
    for session in range(int(rng.integers(2, 9))):
        stream = [int(rng.integers(0, 3))] + list(rng.integers(10 + 1000 * session, 10 + 1000 * (session + 1), 80))
        prompt, t = 0, float(rng.integers(0, 20)) + 0.5
        for turn in range(int(rng.integers(1, 6))):
            prompt += int(rng.integers(h if turn == 0 else 1, 40))  # (the shared first block: a prompt's)
            output = int(rng.integers(1, 40))
            if prompt >= max_model_len:
                break
            covered = prompt + output if rng.random() < 0.8 else prompt
            rows.append(dict(arrival_time_s=t, prompt_tokens=prompt, output_tokens=output,
                             block_hashes=stream[:-(-covered // h)], hash_block_tokens=h,
                             priority=int(rng.integers(0, 3)), session=session, turn=turn))
            prompt += output
            t += float(rng.integers(0, 4))
    frame = pd.DataFrame(rows).sort_values("arrival_time_s", kind="stable").reset_index(drop=True)
    frame["request_id"] = [f"s{s}t{t}" for s, t in zip(frame.session, frame.turn)]
    return frame, random_engine_options(rng, block_size, max_model_len)


def with_adapters(frame: pd.DataFrame, opts: dict, rng: np.random.Generator) -> tuple[pd.DataFrame, dict]:
    """LoRA: each request names one of a few adapters or none (the base model); max_loras 1-3."""
    names = [None] + [f"ad{k}" for k in range(int(rng.integers(1, 5)))]
    frame = frame.copy()
    frame["lora_name"] = [names[int(rng.integers(0, len(names)))] for _ in range(len(frame))]
    return frame, opts | {"enable_lora": True, "max_loras": int(rng.integers(1, 4))}


def _patched_for_lora(oracle: Path) -> None:
    """The oracle copy reads lora_name, gives requests LoRARequests (ids in order of first
    appearance) and its scheduler a LoRA config with max_loras from $ORACLE_MAX_LORAS."""
    patch_once(oracle, "the row's fields", '            "hash_block_tokens": None,\n        }',
               '            "hash_block_tokens": None,\n'
               '            "lora_name": None if _is_missing(r.get("lora_name")) else str(r.get("lora_name")),\n'
               '        }')
    patch_once(oracle, "the request's priority", '            priority=tr["priority"],',
               '            priority=tr["priority"],\n'
               '            lora_request=(__import__("vllm.lora.request", fromlist=["LoRARequest"]).LoRARequest(\n'
               '                tr["lora_name"], LORA_IDS.setdefault(tr["lora_name"], len(LORA_IDS) + 1), "/nonexistent")\n'
               '                if tr["lora_name"] else None),')
    patch_once(oracle, "the scheduler's return", '    return sched, vllm_config',
               '    if os.environ.get("ORACLE_MAX_LORAS"):\n'
               '        sched.lora_config = __import__("types").SimpleNamespace(max_loras=int(os.environ["ORACLE_MAX_LORAS"]))\n'
               '    return sched, vllm_config')
    patch_once(oracle, "the token constants", 'EOS_TOKEN_ID = 2  #', 'LORA_IDS: dict = {}\nEOS_TOKEN_ID = 2  #')


def _previous_turn(frame: pd.DataFrame) -> np.ndarray:
    """Row of each row's previous turn in its session (-1 for first turns)."""
    where = {(s, t): i for i, (s, t) in enumerate(zip(frame.session, frame.turn))}
    return np.array([where.get((s, t - 1), -1) for s, t in zip(frame.session, frame.turn)])


def after_previous_turns(frame: pd.DataFrame, config: EngineConfig) -> pd.DataFrame:
    """Push each turn's arrival past its previous turn's finish in simkv's replay, until every
    turn arrives after its previous one finished (the reply must exist before it is repeated)."""
    prev = _previous_turn(frame)
    for _ in range(30):
        res = replay(trace_from_frame(frame.drop(columns=["session", "turn"])), config, "linear",
                     {"step_base_s": 1.0, "step_per_token_s": 0.0})
        finish = res.requests["finish_time_s"].to_numpy()
        late = np.array([p >= 0 and not (frame.arrival_time_s[i] > finish[p]) for i, p in enumerate(prev)])
        if not late.any():
            return frame
        frame = frame.copy()
        for i in np.flatnonzero(late):
            frame.loc[i, "arrival_time_s"] = np.nan_to_num(finish[prev[i]], nan=frame.arrival_time_s[prev[i]]) + 0.5
        frame = frame.sort_values("arrival_time_s", kind="stable").reset_index(drop=True)
        prev = _previous_turn(frame)
    raise RuntimeError("arrivals did not settle after their previous turns")


def _patched_for_replies(oracle: Path) -> None:
    """The fake model samples a row's content token where its hash list describes the position
    (a list longer than its prompt needs goes on over the reply)."""
    patch_once(oracle, "the sampling line",
               'sampled.append([fake_output_token(rinfo[rid]["row"], req.num_computed_tokens)])',
               'tr = trace[rinfo[rid]["row"]]; pos = req.num_computed_tokens; bh = tr["block_hashes"]\n'
               '                sampled.append([hashed_token_id(int(bh[pos // tr["hash_block_tokens"]]), tr["hash_block_tokens"],'
               ' pos % tr["hash_block_tokens"]) if bh and pos < len(bh) * tr["hash_block_tokens"]'
               ' and len(bh) * tr["hash_block_tokens"] >= tr["prompt_tokens"] + tr["hash_block_tokens"]'
               ' else fake_output_token(rinfo[rid]["row"], pos)])')


def run_oracle(py: str, oracle: Path, trace: Path, opts: dict, prefix: Path, async_scheduling: bool) -> None:
    import os

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
    env = dict(os.environ) | ({"ORACLE_MAX_LORAS": str(opts["max_loras"])} if opts.get("enable_lora") else {})
    subprocess.run(cmd, check=True, capture_output=True, env=env)


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


def late_turns(prefix: Path, prev: np.ndarray) -> list[str]:
    """Turns that arrived before their previous turn finished in the oracle's run."""
    with open(f"{prefix}.requests.csv") as f:
        rows = {int(r["row"]): r for r in csv.DictReader(f)}
    late = [i for i, p in enumerate(prev) if p >= 0 and i in rows and p in rows and rows[p]["finish_time_s"] != ""
            and float(rows[i]["arrival_time_s"]) <= float(rows[p]["finish_time_s"])]
    return [f"{len(late)} turns arrived before their previous turn finished in vLLM's run"] if late else []


def recorded(frame: pd.DataFrame, opts: dict, async_scheduling: bool, prefix: Path) -> dict:
    """A case as tests/core/test_reply_content.py replays it: the trace, options and vLLM's values."""
    summary = json.loads(Path(f"{prefix}.summary.json").read_text())
    with open(f"{prefix}.steps.csv") as f:
        steps = [[int(r["num_scheduled_tokens"]), int(r["num_running"]), int(r["num_waiting"]), int(r["kv_blocks_used"])]
                 for r in csv.DictReader(f)]
    with open(f"{prefix}.requests.csv") as f:
        times = {int(r["row"]): [float(r["first_token_time_s"]), float(r["finish_time_s"])] for r in csv.DictReader(f)
                 if r["first_token_time_s"] != ""}
    trace = {c: [list(map(int, v)) if c == "block_hashes" else (v.item() if hasattr(v, "item") else v)
                 for v in frame[c]] for c in frame.columns}
    return dict(opts=opts, async_scheduling=async_scheduling, trace=trace,
                vllm=dict(num_steps=summary["total_steps"], prefix_hits=summary["prefix_cache"]["hits_all"],
                          steps=steps, times=[times.get(i) for i in range(len(frame))]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle-python", required=True)
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--replies", action="store_true", help="chat sessions whose hash lists describe the replies")
    ap.add_argument("--lora", action="store_true", help="requests name LoRA adapters; max_loras 1-3")
    ap.add_argument("--keep", default="/tmp/oracle_fuzz_failures")
    ap.add_argument("--record", help="write the equal cases (trace, options, vLLM's values) to this JSON file")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    failed = 0
    record = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        oracle = _patched_oracle(tmp)
        if args.replies:
            _patched_for_replies(oracle)
        if args.lora:
            _patched_for_lora(oracle)
        for case in range(args.cases):
            frame, opts = make_reply_case(rng) if args.replies else make_case(rng)
            if args.lora:
                frame, opts = with_adapters(frame, opts, rng)
            try:
                config = EngineConfig.from_flat(opts | {"async_scheduling": args.async_scheduling})
            except ConfigError as exc:
                print(f"case {case}: skipped ({exc})")
                continue
            if args.replies:
                frame = after_previous_turns(frame, config)
                prev = _previous_turn(frame)
                frame = frame.drop(columns=["session", "turn"])
            trace = tmp / f"case{case}.parquet"
            write_trace(frame, trace)
            run_oracle(args.oracle_python, oracle, trace, opts, tmp / f"o{case}", args.async_scheduling)
            res = replay(read_trace(trace), config, "linear",
                         {"step_base_s": 1.0, "step_per_token_s": 0.0})
            diff = differences(tmp / f"o{case}", res)
            if args.replies:
                diff += late_turns(tmp / f"o{case}", prev)
            print(f"case {case}: {len(frame)} requests, {res.summary['num_steps']} steps, "
                  f"{res.summary['num_preemptions']} preemptions, {res.summary['prefix_cache_hits_tokens']} hit tokens: " + ("equal" if not diff else "; ".join(diff)),
                  flush=True)
            if not diff and args.record:
                record.append(recorded(frame, opts, args.async_scheduling, tmp / f"o{case}"))
            if diff:
                failed += 1
                keep = Path(args.keep) / f"case{case}"
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(trace, keep)
                (keep / "options.json").write_text(json.dumps(opts, indent=1))
    print(f"{args.cases - failed} of {args.cases} cases equal")
    if args.record:
        Path(args.record).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
