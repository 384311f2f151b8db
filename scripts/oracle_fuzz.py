"""Random small traces through simkv and the real vLLM scheduler (../shared/tools/vllm_oracle):
every step's scheduled tokens, running and waiting requests and blocks in use, and every
request's first-token and finish time, must agree.

A development aid, not a test dependency (each oracle run takes about 10 s). Needs the oracle's venv:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_fuzz.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 20 [--async-scheduling]
        [--replies] [--lora] [--timeouts]

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

--timeouts: clients give up (simkv/replay/client_timeouts.py) and retry. simkv replays first; the
oracle copy then gets every attempt simkv's clients sent, as a row arriving at its send time
(a retry with its first attempt's prompt tokens), and aborts each request they gave up on with
vLLM's finish_requests(FINISHED_ABORTED), one request at a time: before the output of the step
during which its deadline passed, or at a deadline between steps before the next schedule.

--parallel: some requests ask for n = 2-4 sequences (parallel sampling), which simkv fans out
as vLLM v1's front end does (`parallel_sampling: fan_out`); the oracle gets the n requests one
after the other, with one prompt (their rows' hash lists, made up where a row has none, so that
they share the prompt's tokens). A row's first token is its first request's, its finish the last.

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


def with_parallel_sampling(frame: pd.DataFrame, opts: dict, rng: np.random.Generator) -> tuple[pd.DataFrame, dict]:
    """About a third of the requests ask for 2-4 sequences; simkv fans them out."""
    frame = frame.copy()
    frame["n"] = np.where(rng.random(len(frame)) < 0.35, rng.integers(2, 5, len(frame)), 1)
    return frame, opts | {"parallel_sampling": "fan_out"}


def fanned_out(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[int, int]]]:
    """The oracle's trace of a case with parallel sampling: row i as n[i] requests in a row, with
    one prompt (a made-up hash list of 8-token blocks where the row has none: ids no other row
    uses), and each oracle row's (row, member)."""
    rows, origin = [], []
    for i, r in enumerate(frame.to_dict("records")):
        n = int(r.pop("n"))
        if n > 1 and not len(r.get("block_hashes", []) or []):
            r["block_hashes"] = [1000 + 64 * i + j for j in range(-(-int(r["prompt_tokens"]) // 8))]
            r["hash_block_tokens"] = 8
        for k in range(n):
            rows.append(dict(r, request_id=f"r{i}" if k == 0 else f"r{i}#{k}"))
            origin.append((i, k))
    out = pd.DataFrame(rows)
    if "block_hashes" in out:
        out["block_hashes"] = [list(v) if isinstance(v, (list, np.ndarray)) else [] for v in out["block_hashes"]]
        out["hash_block_tokens"] = out["hash_block_tokens"].fillna(8).astype(int)
    return out, origin


def fanned_out_differences(prefix: Path, res, origin: list[tuple[int, int]]) -> list[str]:
    """Every step, and each row's first token (its first request's) and finish (its last)."""
    out = engine_differences(prefix, res)
    with open(f"{prefix}.requests.csv") as f:
        by_row = {int(r["row"]): r for r in csv.DictReader(f)}
    first, finish = {}, {}
    for j, (i, k) in enumerate(origin):
        r = by_row.get(j)
        if r is None or r["first_token_time_s"] == "":
            continue
        if k == 0:
            first[i] = float(r["first_token_time_s"])
        finish[i] = max(finish.get(i, 0.0), float(r["finish_time_s"]))
    req = res.requests
    for i, (a, b) in enumerate(zip(req["first_token_time_s"].tolist(), req["finish_time_s"].tolist())):
        if i not in first:
            continue
        if abs(first[i] - a) > 1e-6 or abs(finish[i] - b) > 1e-6:
            out.append(f"request {i}: vLLM first token/finish {first[i]}/{finish[i]}, simkv {a:.3f}/{b:.3f}")
            break
    return out


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


def with_timeouts(opts: dict, rng: np.random.Generator) -> dict:
    """Clients that give up after whole seconds (deadlines on step boundaries that follow an
    arrival: a token there is in time) or a quarter second more (inside a step: a request that
    finishes in it finishes after its client left), and retry 0-2 times after whole-second
    back-offs."""
    out = dict(opts)
    extra = 0.25 if rng.random() < 0.5 else 0.0
    if rng.random() < 0.7:
        out["client_ttft_timeout_s"] = float(rng.integers(2, 15)) + extra
    if "client_ttft_timeout_s" not in out or rng.random() < 0.5:
        out["client_timeout_s"] = float(rng.integers(5, 60)) + extra
    out["client_max_retries"] = int(rng.integers(0, 3))
    out["client_retry_backoff_s"] = float(rng.integers(0, 4))
    return out


def _patched_for_parallel(oracle: Path) -> None:
    """The oracle copy stamps a fanned-out request's members (ids `first` and `first#k`) with
    one arrival time, as vLLM's front end copies the parent's to its children (the oracle's
    own stamps are one nanosecond apart per row, wall-clock arrivals that never tie); vLLM then
    queues them by request id and preempts the first of them in running order."""
    patch_once(oracle, "the arrival stamp", "            req = make_request(tr, float(tr[key]) + next_idx * 1e-9)\n",
               "            first = GROUP_FIRST.setdefault(str(tr['request_id']).split('#')[0], next_idx)\n"
               "            req = make_request(tr, float(tr[key]) + first * 1e-9)\n")
    patch_once(oracle, "the token constants", 'EOS_TOKEN_ID = 2  #', 'GROUP_FIRST: dict = {}\nEOS_TOKEN_ID = 2  #')


def _patched_for_aborts(oracle: Path) -> None:
    """The oracle copy aborts the requests named in the JSON file $ORACLE_ABORTS ([request_id,
    time] pairs, in time order) with vLLM's finish_requests(FINISHED_ABORTED): those whose time
    falls inside a step before that step's output is processed (vLLM's engine core drains its
    aborts queue there), the others before the next schedule; one by one, as a front end sends
    them (one finish_requests call with several ids frees them in set order, which varies with
    Python's string hashing); a trace column content_row gives a row another row's
    request-unique prompt tokens (a retry resends its first attempt's prompt)."""
    patch_once(oracle, "the row number", '            "row": idx,\n',
               '            "row": idx if _is_missing(r.get("content_row")) else int(float(r["content_row"])),\n')
    patch_once(oracle, "the loop's arrivals", "        arrivals = add_arrivals()\n",
               "        take_aborts((batch_queue[0][2]['time_s'] if batch_queue and batch_queue[0][2] is not None\n"
               "                     else clock) + 1e-12)  # (async: the step in flight started then)\n"
               "        arrivals = add_arrivals()\n")
    patch_once(oracle, "the step's update", "        engine_outputs = sched.update_from_output(so, mro)\n",
               "        if row is not None:\n"
               "            take_aborts(row['time_end_s'] - 1e-9)  # (those that arrived while the step ran)\n"
               "        engine_outputs = sched.update_from_output(so, mro)\n")
    patch_once(oracle, "the step loop", "\n    idle_guard = 0\n    while True:\n",
               "\n    def take_aborts(upto):\n"
               "        while ABORTS and ABORTS[0][1] <= upto:\n"
               "            rid = ABORTS.pop(0)[0]\n"
               "            if rid in sched.requests and not sched.requests[rid].is_finished():\n"
               "                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)\n"
               "\n"
               "    idle_guard = 0\n"
               "    while True:\n")
    patch_once(oracle, "the token constants", 'EOS_TOKEN_ID = 2  #',
               'ABORTS: list = json.load(open(os.environ["ORACLE_ABORTS"])) if os.environ.get("ORACLE_ABORTS") else []\n'
               'EOS_TOKEN_ID = 2  #')


class AttemptLog:
    """What simkv's clients did in a replay: every attempt sent (row, request id, tick) and every
    abort vLLM got (request id, deadline tick), recorded by wrapping ClientTimeoutFeed."""

    def __init__(self) -> None:
        from simkv.replay.client_timeouts import ClientTimeoutFeed

        self.sends: list[tuple[int, str, int]] = []
        self.aborts: dict[str, int] = {}
        log = self
        send, give_up = ClientTimeoutFeed._send, ClientTimeoutFeed._give_up

        def logged_send(feed, request, row, tick, attempt):
            log.sends.append((row, request.request_id, tick))
            send(feed, request, row, tick, attempt)

        def logged_give_up(feed, row, request, attempt, at, kind, now):
            log.aborts[request.request_id] = at
            give_up(feed, row, request, attempt, at, kind, now)
        ClientTimeoutFeed._send, ClientTimeoutFeed._give_up = logged_send, logged_give_up
        self._restore = (send, give_up)

    def close(self) -> None:
        from simkv.replay.client_timeouts import ClientTimeoutFeed

        ClientTimeoutFeed._send, ClientTimeoutFeed._give_up = self._restore

    def oracle_trace(self, frame: pd.DataFrame) -> pd.DataFrame:
        """Every attempt as a row of its own, in the order simkv sent them. With parallel sampling,
        an attempt's n requests one after the other: the first with the attempt's id, the others
        with simkv's member ids; their one prompt from a made-up hash list where the row has
        none (as `fanned_out`), and the others' outputs their own (the fake model samples by
        content_row, which a retry's first request shares with its first attempt's, as simkv's
        first members share their output blocks' keys)."""
        from simkv.clock import TICKS_PER_SECOND

        rows = []
        for j, (row, request_id, tick) in enumerate(self.sends):
            r = frame.iloc[row].to_dict()
            n = int(r.pop("n", 1))
            if n > 1 and not len(r.get("block_hashes", []) or []):
                r["block_hashes"] = [1000 + 64 * row + b for b in range(-(-int(r["prompt_tokens"]) // 8))]
                r["hash_block_tokens"] = 8
            for k in range(n):
                rows.append(r | {"request_id": request_id if k == 0 else f"{request_id}#{k}",
                                 "content_row": row if k == 0 else 10 ** 6 + 8 * j + k,
                                 "arrival_time_s": tick / TICKS_PER_SECOND})
        out = pd.DataFrame(rows)
        if "block_hashes" in out:  # (the oracle reads "1 2 3" from CSV)
            out["block_hashes"] = [" ".join(str(int(h)) for h in hashes) if isinstance(hashes, (list, np.ndarray))
                                   else "" for hashes in out["block_hashes"]]
            out["hash_block_tokens"] = out["hash_block_tokens"].fillna(8).astype(int)
        return out


def aborted_members(log: AttemptLog, frame: pd.DataFrame) -> list[list]:
    """The aborts the oracle gets, [request id, time] in time order: a fanned-out attempt's
    members after its first (as simkv aborts them)."""
    from simkv.clock import TICKS_PER_SECOND

    row_of = {rid: row for row, rid, _ in log.sends}
    n = frame["n"].tolist() if "n" in frame else [1] * len(frame)
    out = []
    for rid, tick in log.aborts.items():  # (in the order simkv took them: deadline order)
        out += [[rid if k == 0 else f"{rid}#{k}", tick / TICKS_PER_SECOND] for k in range(int(n[row_of[rid]]))]
    return out


def timeout_differences(prefix: Path, res, log: AttemptLog) -> list[str]:
    """As `differences`, requests by their final attempt's id (fanned out: its first member's first
    token, its last member's finish)."""
    out = engine_differences(prefix, res)
    with open(f"{prefix}.requests.csv") as f:
        rows = {r["request_id"]: r for r in csv.DictReader(f)}
    last = {row: rid for row, rid, _ in log.sends}
    req = res.requests
    for i, (status, a, b) in enumerate(zip(req["status"], req["first_token_time_s"], req["finish_time_s"])):
        if status != "finished":
            continue
        t = rows.get(last[i])
        members = [rows.get(rid) for rid in rows if rid.startswith(f"{last[i]}#")]
        if t is not None and t["finish_time_s"] != "" and all(m["finish_time_s"] != "" for m in members):
            t = dict(t, finish_time_s=str(max(float(m["finish_time_s"]) for m in [t, *members])))
        if t is None or t["finish_time_s"] == "" or abs(float(t["first_token_time_s"]) - a) > 1e-6 \
                or abs(float(t["finish_time_s"]) - b) > 1e-6:
            out.append(f"request {i} ({last[i]}): vLLM {t and (t['first_token_time_s'], t['finish_time_s'])}, "
                       f"simkv {a:.3f}/{b:.3f}")
            break
    return out


def _previous_turn(frame: pd.DataFrame) -> np.ndarray:
    """Row of each row's previous turn in its session (-1 for first turns)."""
    where = {(s, t): i for i, (s, t) in enumerate(zip(frame.session, frame.turn))}
    return np.array([where.get((s, t - 1), -1) for s, t in zip(frame.session, frame.turn)])


def after_previous_turns(frame: pd.DataFrame, config: EngineConfig) -> pd.DataFrame:
    """Push each turn's arrival past its previous turn's end in simkv's replay, until every turn
    arrives after its previous one ended (the reply must exist before it is repeated): its finish,
    or with --timeouts, for a turn its clients gave up on, a step after its last abort (simkv makes
    a reply's blocks findable when its request releases them, vLLM as they fill)."""
    from simkv.clock import TICKS_PER_SECOND

    prev = _previous_turn(frame)
    for _ in range(30):
        log = AttemptLog() if config.scheduler.has_client_timeouts else None
        try:
            res = replay(trace_from_frame(frame.drop(columns=["session", "turn"])), config, "linear",
                         {"step_base_s": 1.0, "step_per_token_s": 0.0})
        finally:
            if log is not None:
                log.close()
        end = res.requests["finish_time_s"].to_numpy().copy()
        if log is not None:
            row_of = {rid: row for row, rid, _ in log.sends}
            for rid, tick in log.aborts.items():
                row = row_of[rid]
                if res.requests["status"][row] == "timed_out":
                    end[row] = np.fmax(end[row], tick / TICKS_PER_SECOND + 1.0)
        late = np.array([p >= 0 and not (frame.arrival_time_s[i] > end[p]) for i, p in enumerate(prev)])
        if not late.any():
            return frame
        frame = frame.copy()
        for i in np.flatnonzero(late):
            frame.loc[i, "arrival_time_s"] = np.nan_to_num(end[prev[i]], nan=frame.arrival_time_s[prev[i]]) + 0.5
        frame = frame.sort_values("arrival_time_s", kind="stable").reset_index(drop=True)
        prev = _previous_turn(frame)
    raise RuntimeError("arrivals did not settle after their previous turns")


def _patched_for_replies(oracle: Path) -> None:
    """The fake model samples a row's content token where its hash list describes the position
    (a list longer than its prompt needs goes on over the reply). (The row by request id: with
    --timeouts a trace row is an attempt, and its "row" the trace row whose content it has.)"""
    patch_once(oracle, "the sampling line",
               'sampled.append([fake_output_token(rinfo[rid]["row"], req.num_computed_tokens)])',
               'tr = next(t for t in trace if t["request_id"] == rid); pos = req.num_computed_tokens; '
               'bh = tr["block_hashes"]\n'
               '                sampled.append([hashed_token_id(int(bh[pos // tr["hash_block_tokens"]]), tr["hash_block_tokens"],'
               ' pos % tr["hash_block_tokens"]) if bh and pos < len(bh) * tr["hash_block_tokens"]'
               ' and len(bh) * tr["hash_block_tokens"] >= tr["prompt_tokens"] + tr["hash_block_tokens"]'
               ' else fake_output_token(rinfo[rid]["row"], pos)])')


def run_oracle(py: str, oracle: Path, trace: Path, opts: dict, prefix: Path, async_scheduling: bool,
               aborts: Path | None = None) -> None:
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
    if aborts is not None:
        env["ORACLE_ABORTS"] = str(aborts)
    subprocess.run(cmd, check=True, capture_output=True, env=env)


def engine_differences(prefix: Path, res) -> list[str]:
    """The step count, preemptions, prefix hits and every step of an oracle run against a replay's."""
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
    return out


def differences(prefix: Path, res) -> list[str]:
    out = engine_differences(prefix, res)
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


def recorded(frame: pd.DataFrame, opts: dict, async_scheduling: bool, prefix: Path,
             log: AttemptLog | None = None, finished: np.ndarray | None = None,
             origin: list[tuple[int, int]] | None = None) -> dict:
    """A case as tests/core/test_reply_content.py replays it: the trace, options and vLLM's values
    (with client time-outs, a row's times are its last attempt's, where vLLM finished that one and
    simkv's client still waited: `finished`)."""
    summary = json.loads(Path(f"{prefix}.summary.json").read_text())
    with open(f"{prefix}.steps.csv") as f:
        steps = [[int(r["num_scheduled_tokens"]), int(r["num_running"]), int(r["num_waiting"]), int(r["kv_blocks_used"])]
                 for r in csv.DictReader(f)]
    with open(f"{prefix}.requests.csv") as f:
        by_id = {r["request_id"]: r for r in csv.DictReader(f)}
    if origin is not None:  # (parallel sampling: a row's first request's first token, its last one's finish)
        times = {}
        for r in by_id.values():
            if r["first_token_time_s"] != "":
                i, k = origin[int(r["row"])]
                first, finish = times.get(i, [None, 0.0])
                times[i] = [float(r["first_token_time_s"]) if k == 0 else first, max(finish, float(r["finish_time_s"]))]
    elif log is None:
        times = {int(r["row"]): [float(r["first_token_time_s"]), float(r["finish_time_s"])] for r in by_id.values()
                 if r["first_token_time_s"] != ""}
    else:
        final = {row: rid for row, rid, _ in log.sends}  # (a row's last send wins; times of those simkv's
        times = {row: [float(by_id[rid]["first_token_time_s"]), float(by_id[rid]["finish_time_s"])]  # clients waited for)
                 for row, rid in final.items() if rid in by_id and by_id[rid]["finish_time_s"] != "" and finished[row]}
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
    ap.add_argument("--timeouts", action="store_true", help="clients give up (vLLM aborts) and retry")
    ap.add_argument("--parallel", action="store_true", help="requests for n > 1 sequences, fanned out")
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
        if args.timeouts:
            _patched_for_aborts(oracle)
        if args.parallel:
            _patched_for_parallel(oracle)
        for case in range(args.cases):
            frame, opts = make_reply_case(rng) if args.replies else make_case(rng)
            if args.lora:
                frame, opts = with_adapters(frame, opts, rng)
            if args.timeouts:
                opts = with_timeouts(opts, rng)
            if args.parallel:
                frame, opts = with_parallel_sampling(frame, opts, rng)
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
            if args.timeouts:  # (simkv first: the oracle gets the attempts simkv's clients sent and aborted)
                log = AttemptLog()
                try:
                    res = replay(read_trace(trace), config, "linear", {"step_base_s": 1.0, "step_per_token_s": 0.0})
                finally:
                    log.close()
                attempts = tmp / f"attempts{case}.csv"
                log.oracle_trace(frame).to_csv(attempts, index=False)
                aborts = tmp / f"aborts{case}.json"
                aborts.write_text(json.dumps(aborted_members(log, frame)))
                run_oracle(args.oracle_python, oracle, attempts, opts, tmp / f"o{case}", args.async_scheduling, aborts)
                diff = timeout_differences(tmp / f"o{case}", res, log)
                c = res.summary["client"]
                print(f"case {case}: {c['attempts']} attempts, {c['aborted']} aborted, "
                      f"{c['timed_out_requests']} timed out; ", end="")
            elif args.parallel:
                expanded, origin = fanned_out(frame)
                oracle_trace = tmp / f"fanned{case}.parquet"
                write_trace(expanded, oracle_trace)
                run_oracle(args.oracle_python, oracle, oracle_trace, opts, tmp / f"o{case}", args.async_scheduling)
                res = replay(read_trace(trace), config, "linear", {"step_base_s": 1.0, "step_per_token_s": 0.0})
                diff = fanned_out_differences(tmp / f"o{case}", res, origin)
            else:
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
                record.append(recorded(frame, opts, args.async_scheduling, tmp / f"o{case}",
                                       log if args.timeouts else None,
                                       (res.requests["status"] == "finished").to_numpy(),
                                       origin if args.parallel else None))
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
