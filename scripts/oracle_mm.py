"""Multimodal (image) encoder inputs in the engine core, against the real vLLM scheduler.

Random small traces whose requests carry image items (trace columns mm_offsets, mm_lengths,
mm_hashes: each item's placeholder tokens in the prompt and its identifier) through simkv's
replay and vLLM 0.33's `Scheduler` (its `AsyncScheduler` with --async-scheduling), the oracle's
time mode (../shared/tools/vllm_oracle/oracle.py, patched here: each request gets one
MultiModalFeatureSpec per item, and the scheduler of the oracle's text-only fake model gets
the encoder compute budget and encoder cache that vLLM's compute_mm_encoder_budget gives a
multimodal one: max(max_num_batched_tokens, the largest item or mm_max_tokens_per_item), and
disable_chunked_mm_input). Every step's scheduled tokens, running and waiting requests and
blocks in use, the step count, preemptions and prefix-hit tokens, and every request's
first-token and finish time must be equal (oracle_fuzz.differences); a case whose largest item
(or mm_max_tokens_per_item) exceeds max_num_batched_tokens under disable_chunked_mm_input must be
refused by both (vLLM's ValueError, simkv's ConfigError).

A development aid, not a test dependency (vLLM's side runs every case in one process):
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_mm.py --cases 50 [--seed 1] [--async-scheduling]
        [--disable-chunked-mm-input] [--keep DIR] [--record FILE [--record-count 8 | --record-cases I,J] [--record-append]]

Content: vLLM keys a KV block with the identifiers (and in-block offsets) of the items that
overlap it, simkv knows content only by the rows' hash ids (8-token hash blocks). So a case's
shared prompts are prefixes of three streams (a stream-unique first hash block, then text blocks
and image segments); an image is a run of hash ids with its item at a fixed offset into its
first block and a fixed length, and its identifier is a hash of (the ids the item covers, that
offset, the length): equal content has equal items and identifiers, so both sides find the same
prefix hits. A prompt never ends inside an item (it takes the stream's items before its end). The
images recur across streams at other positions (the encoder cache shared without a KV hit) and
within a stream (an item repeated in one request). Other rows have unique tokens and items
with identifiers of their own. Item lengths 1 to 2 x max_num_batched_tokens (16 to 128 with
chunked prefill), mm_max_tokens_per_item above the largest item in a third of the cases, small
pools that preempt, prefix caching on and off, FCFS and priority (oracle_fuzz.py's engines).

--disable-chunked-mm-input: every case runs with it, its items within max_num_batched_tokens
except in about one case in six, which both sides must refuse, and within the long-prefill
threshold (a larger one vLLM stalls for good while other requests are around: every chunk that
reaches it is rolled back to its start; simkv refuses that configuration). A case that differs is kept in
--keep (its trace, options, and vLLM's step and request CSVs) for a look.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import oracle_vllm  # noqa: E402  (the two-venv dance: serve_vllm_side, vllm_results)

H = 8  # tokens per hash block (the oracle's make_prompt_ids)
MM_COLUMNS = ("mm_offsets", "mm_lengths", "mm_hashes")

# ---- the oracle copy's patches (run in vLLM's venv) -----------------------------------------------
_HELPERS = '''
MM_CONFIG: dict = {}  # (oracle_mm.py) the case's encoder budget: max_tokens_per_item, disable_chunked_mm_input
MM_IDLE = [0]  # schedule() calls in a row that ran nothing (async: the oracle's loop never calls it a deadlock)


def _mm_items(r) -> list:
    """A trace row's items: (offset, length, identifier) from mm_offsets, mm_lengths, mm_hashes."""
    offsets = r.get("mm_offsets")
    if offsets is None or isinstance(offsets, float):
        return []
    return [(int(o), int(n), int(h)) for o, n, h in zip(offsets, r["mm_lengths"], r["mm_hashes"])]


def _mm_features(tr):
    """One MultiModalFeatureSpec per item (oracle_vllm's: no data, the fake model computes nothing)."""
    from oracle_vllm import mm_features
    return mm_features(tr)


def _mm_budget(sched, vllm_config) -> None:
    """The encoder compute budget and cache a multimodal model's scheduler gets (oracle_vllm's, from
    vLLM's compute_mm_encoder_budget: its ValueError for an item larger than max_num_batched_tokens
    under disable_chunked_mm_input included)."""
    from oracle_vllm import mm_budget
    mm_budget(sched, vllm_config, MM_CONFIG if MM_CONFIG.get("max_tokens_per_item") else None)


'''


def mm_oracle(tmp: Path) -> Path:
    """oracle_compare's patched oracle copy (async arrivals), its rows' items as vLLM's
    mm_features, its scheduler with the encoder budget of `MM_CONFIG`."""
    from oracle_compare import _patched_oracle, patch_once

    path = _patched_oracle(tmp)
    patch_once(path, "the make_prompt_ids definition", "def make_prompt_ids(", _HELPERS + "def make_prompt_ids(")
    patch_once(path, "the row's fields", '            "hash_block_tokens": None,\n        }',
               '            "hash_block_tokens": None,\n            "mm": _mm_items(r),\n        }')
    patch_once(path, "the request's priority", '            priority=tr["priority"],',
               '            priority=tr["priority"],\n            mm_features=_mm_features(tr),')
    patch_once(path, "the scheduler's return", "    return sched, vllm_config",
               "    _mm_budget(sched, vllm_config)\n    return sched, vllm_config")
    # (a stall under async scheduling with arrivals to come: the oracle's loop would schedule nothing forever)
    patch_once(path, "the empty step", "                # nothing scheduled (only legal while outputs are still in flight)\n",
               "                # nothing scheduled (only legal while outputs are still in flight)\n"
               "                MM_IDLE[0] += 1\n"
               "                if MM_IDLE[0] > 10_000:\n"
               "                    raise SystemExit(f\"deadlock at step {step}: nothing schedulable (running={n_running}, \"\n"
               "                                     f\"waiting={n_waiting}, free={free_blocks}; async)\")\n")
    # (an empty step that preempted: vLLM's engine core calls schedule() again, which the freed
    # encoder-cache room or blocks may let run; the oracle's loop would call it a deadlock)
    patch_once(path, "the deadlock check", "                    if next_idx >= len(order):\n"
               "                        raise SystemExit(\n"
               "                            f\"deadlock at step {step}: nothing schedulable",
               "                    if next_idx >= len(order) and not n_preempted:\n"
               "                        raise SystemExit(\n"
               "                            f\"deadlock at step {step}: nothing schedulable")
    patch_once(path, "the executed step", "            if executed:\n                row = {",
               "            if executed:\n                MM_IDLE[0] = 0\n                row = {")
    return path


_modules: dict = {}


def run_vllm(case: dict) -> dict:
    """(vLLM's venv) One case through the patched oracle's `run`, in this process: its CSVs
    and summary at the case's prefix; {"error": ...} where vLLM refused or failed."""
    import importlib.util

    path = case["oracle"]
    if path not in _modules:
        spec = importlib.util.spec_from_file_location("oracle_mm_copy", path)
        _modules[path] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_modules[path])
    oracle = _modules[path]
    oracle.MM_CONFIG = case["mm"]
    oracle.MM_IDLE[0] = 0
    argv = sys.argv
    sys.argv = [path] + case["argv"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            oracle.main()
    except (Exception, SystemExit) as exc:  # (a refused configuration, a deadlock the oracle reports)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        sys.argv = argv
    return {}


# ---- the cases (simkv's venv) ---------------------------------------------------------------------
def identifier(ids, offset: int, length: int) -> int:
    """An item's identifier: a hash of the hash ids its placeholder tokens cover, its offset into
    the first of those blocks, and its length (equal content, equal identifier)."""
    key = json.dumps([[int(x) for x in ids], offset % H, length])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "big")


def item_length(rng, budget: int, cap: int) -> int:
    """1 to `cap` placeholder tokens: a few, any, or about the token budget."""
    u = rng.random()
    if u < 0.3:
        n = int(rng.integers(1, 9))
    elif u < 0.7:
        n = int(rng.integers(1, cap + 1))
    else:
        n = int(rng.choice([budget - 1, budget, budget + 1, 2 * budget]))
    return max(1, min(n, cap))


def make_images(rng, budget: int, cap: int) -> list[dict]:
    """1 to 4 images: an item of a drawn length at an offset of 0-7 into its first hash block, over
    hash ids of its own."""
    images = []
    for k in range(int(rng.integers(1, 5))):
        length, start = item_length(rng, budget, cap), int(rng.integers(0, H))
        ids = [10_000_000 + 1_000 * k + j for j in range(-(-(start + length) // H))]
        images.append(dict(ids=ids, start=start, length=length, hash=identifier(ids, start, length)))
    return images


def make_stream(rng, s: int, images: list[dict], max_model_len: int) -> tuple[list[int], list[tuple]]:
    """A stream's hash ids (a first block of its own, then text blocks and image segments) and its
    items (offset, length, identifier), all ending before max_model_len."""
    blocks, items = [1_000_000 * (s + 1)], []
    while len(blocks) * H < max_model_len:
        if len(items) < 4 and rng.random() < 0.35:
            image = images[int(rng.integers(0, len(images)))]
            offset = len(blocks) * H + image["start"]
            if offset + image["length"] < max_model_len:
                items.append((offset, image["length"], image["hash"]))
                blocks += image["ids"]
                continue
        blocks.append(1_000_000 * (s + 1) + len(blocks))
    return blocks, items


def stream_row(rng, blocks: list[int], items: list[tuple], max_model_len: int) -> tuple[int, list, list]:
    """A prompt on a stream: a prefix that ends outside its items (at an item's start or end
    instead), its hash ids and the items it holds."""
    prompt = int(rng.integers(1, max_model_len))
    for offset, length, _ in items:
        if offset < prompt < offset + length:
            prompt = offset + length if rng.random() < 0.5 else offset
    return prompt, blocks[:-(-prompt // H)], [it for it in items if it[0] + it[1] <= prompt]


def unique_row(rng, row: int, budget: int, cap: int, max_model_len: int) -> tuple[int, list, list]:
    """A prompt of unique tokens with 0-3 items of identifiers of their own."""
    prompt = int(rng.integers(1, max_model_len))
    items, pos = [], 0
    for k in range(int(rng.integers(0, 4))):
        pos += int(rng.integers(0, 20))
        if pos >= prompt:
            break
        length = min(item_length(rng, budget, cap), prompt - pos)
        items.append((pos, length, 9_000_000_000 + 10 * row + k))
        pos += length
    return prompt, [], items


def item_cap(opts: dict, max_model_len: int, unchunked: bool) -> int:
    """The largest item a case draws: twice the token budget (within the model length), and
    under disable_chunked_mm_input within the budget and the long-prefill threshold."""
    budget = opts["max_num_batched_tokens"]
    cap = min(2 * budget, max_model_len - 2)
    if unchunked:
        cap = min(cap, budget)
        if opts["long_prefill_token_threshold"]:
            cap = min(cap, opts["long_prefill_token_threshold"])
    return cap


def make_case(rng, disable_chunked: bool):
    """A trace frame (sorted by arrival) and flat engine options. Under `disable_chunked` items
    fit the long-prefill threshold too: a larger one never fits a chunk (vLLM stalls the request
    for good; simkv refuses)."""
    import numpy as np
    import pandas as pd
    from oracle_fuzz import random_engine_options

    block_size = int(rng.choice([4, 8, 16]))
    max_model_len = int(rng.choice([64, 128, 256]))
    opts = random_engine_options(rng, block_size, max_model_len)
    if opts["enable_chunked_prefill"]:  # (small token and encoder budgets)
        opts["max_num_batched_tokens"] = max(int(rng.choice([16, 32, 64, 128])), opts["max_num_seqs"])
    budget = opts["max_num_batched_tokens"]
    refuse = disable_chunked and budget < max_model_len - 2 and rng.random() < 0.17
    cap = item_cap(opts, max_model_len, disable_chunked and not refuse)
    images = make_images(rng, budget, cap)
    streams = [make_stream(rng, s, images, max_model_len) for s in range(3)]
    shared = rng.random() < 0.8
    n = int(rng.integers(3, 40))
    rows = []
    for row in range(n):
        if shared and rng.random() < 0.75:
            prompt, ids, items = stream_row(rng, *streams[int(rng.integers(0, 3))], max_model_len)
        else:
            prompt, ids, items = unique_row(rng, row, budget, cap, max_model_len)
        rows.append(dict(prompt_tokens=prompt, output_tokens=int(rng.integers(1, 60)), priority=int(rng.integers(0, 3)),
                         block_hashes=[int(x) for x in ids], hash_block_tokens=H,
                         mm_offsets=[it[0] for it in items], mm_lengths=[it[1] for it in items],
                         mm_hashes=[it[2] for it in items]))
    frame = pd.DataFrame(rows)
    frame.insert(0, "arrival_time_s", np.sort(rng.integers(0, 40, n)) + 0.5)
    largest = max([max(r["mm_lengths"], default=0) for r in rows], default=0)
    if refuse and largest <= budget:  # (an item larger than the budget no row happened to hold)
        opts["mm_max_tokens_per_item"] = budget + int(rng.integers(1, budget + 1))
    elif rng.random() < 0.33 and largest:
        more = int(rng.integers(1, budget + 1))
        opts["mm_max_tokens_per_item"] = min(largest + more, budget) if disable_chunked and largest <= budget \
            else largest + more
    opts["disable_chunked_mm_input"] = disable_chunked
    return frame, opts


def mm_budget(frame, opts: dict) -> dict:
    """vLLM's side of the encoder options: the largest item (simkv's default) or the option."""
    largest = max((max(v, default=0) for v in frame["mm_lengths"]), default=0)
    return {"max_tokens_per_item": opts.get("mm_max_tokens_per_item") or largest,
            "disable_chunked_mm_input": opts["disable_chunked_mm_input"]}


def write_oracle_trace(frame, path: Path) -> None:
    """The frame as the oracle reads it (simkv's write_trace keeps only the columns simkv knows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lists = pa.list_(pa.int64())
    types = {"block_hashes": lists, **{c: lists for c in MM_COLUMNS}}
    table = pa.table({c: pa.array(frame[c].tolist(), types.get(c)) for c in frame.columns})
    pq.write_table(table, path)


def oracle_argv(oracle: Path, trace: Path, opts: dict, prefix: Path, async_scheduling: bool) -> list[str]:
    """The oracle's `run` arguments for a case: those oracle_fuzz.run_oracle passes."""
    import oracle_fuzz

    seen = []
    with mock.patch.object(subprocess, "run", lambda cmd, **kw: seen.append(cmd)):
        oracle_fuzz.run_oracle("python", oracle, trace, opts, prefix, async_scheduling)
    return [str(x) for x in seen[0][2:]]


def run_simkv(frame, opts: dict, async_scheduling: bool):
    """simkv's replay of the case (1 s steps), or the error's text where simkv refuses it
    (ConfigError) or stops (an engine that cannot make progress)."""
    from simkv.config import EngineConfig
    from simkv.replay.api import replay
    from simkv.traces.schema import trace_from_frame

    try:
        config = EngineConfig.from_flat(opts | {"async_scheduling": async_scheduling})
        return replay(trace_from_frame(frame), config, "linear", {"step_base_s": 1.0, "step_per_token_s": 0.0})
    except Exception as exc:  # noqa: BLE001  (reported as the case's outcome)
        return f"{type(exc).__name__}: {exc}"


def items_summary(frame) -> str:
    hashes = [h for v in frame["mm_hashes"] for h in v]
    repeated = sum(1 for h in set(hashes) if hashes.count(h) > 1)
    return f"{len(hashes)} items ({repeated} identifiers in several)"


def record_score(frame, opts: dict, async_scheduling: bool, res, prefix: Path) -> int:
    """How much an equal case is worth recording: first that vLLM's steps need the items (a replay
    without them differs), then that they need disable_chunked_mm_input (one without it differs),
    then preemptions, identifiers in several rows or twice in one, and prefix hits."""
    from oracle_fuzz import differences

    hashes = [h for v in frame["mm_hashes"] for h in v]
    plain = run_simkv(frame.drop(columns=list(MM_COLUMNS)),
                      {k: v for k, v in opts.items() if k != "mm_max_tokens_per_item"}, async_scheduling)
    score = 1000 * (isinstance(plain, str) or bool(differences(prefix, plain)))
    if opts["disable_chunked_mm_input"]:
        chunked = run_simkv(frame, opts | {"disable_chunked_mm_input": False}, async_scheduling)
        score += 500 * (isinstance(chunked, str) or bool(differences(prefix, chunked)))
    return score + res.summary["num_preemptions"] + len(hashes) - len(set(hashes)) + \
        (res.summary["prefix_cache_hits_tokens"] > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle-python", default="/tmp/vllm-oracle-venv/bin/python")
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--async-scheduling", action="store_true",
                    help="vLLM's AsyncScheduler, two batches deep (the oracle's batch queue)")
    ap.add_argument("--disable-chunked-mm-input", action="store_true",
                    help="disable_chunked_mm_input in every case (about one in six refused by both)")
    ap.add_argument("--keep", default="/tmp/oracle_mm_failures", help="where differing cases are kept")
    ap.add_argument("--record", type=Path, help="write equal cases (trace, options, vLLM's values) to this JSON "
                                                "file, as scripts/oracle_fuzz.py --record does")
    ap.add_argument("--record-count", type=int, default=8, help="with --record: the N best (record_score: the items "
                                                                "matter, then preemptions, repeated identifiers)")
    ap.add_argument("--record-append", action="store_true", help="with --record: add to the file's cases")
    ap.add_argument("--record-cases", default=None, metavar="I,J",
                    help="with --record: these cases (by index), instead of the best --record-count")
    ap.add_argument("--vllm-side", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.save = None  # (oracle_vllm.vllm_results: no --save here)
    if oracle_vllm.serve_vllm_side(a, run_vllm):
        return
    import numpy as np
    from oracle_fuzz import differences, recorded

    started = time.time()
    rng = np.random.default_rng(a.seed)
    with contextlib.ExitStack() as stack:
        import tempfile

        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        oracle = mm_oracle(tmp)
        cases, jobs = [], []
        for i in range(a.cases):
            frame, opts = make_case(rng, a.disable_chunked_mm_input)
            trace = tmp / f"case{i}.parquet"
            write_oracle_trace(frame, trace)
            cases.append((frame, opts))
            jobs.append({"oracle": str(oracle), "mm": mm_budget(frame, opts),
                         "argv": oracle_argv(oracle, trace, opts, tmp / f"o{i}", a.async_scheduling)})
        theirs = oracle_vllm.vllm_results(__file__, jobs, a)
        vllm_s = time.time() - started
        failed = refused = 0
        saved = []
        for i, ((frame, opts), t) in enumerate(zip(cases, theirs)):
            ours = run_simkv(frame, opts, a.async_scheduling)
            prefix = tmp / f"o{i}"
            if isinstance(ours, str) or "error" in t:
                both = isinstance(ours, str) and ours.startswith("ConfigError") and \
                    t.get("error", "").startswith("ValueError")
                diff = [] if both else [f"vLLM {t.get('error', 'ran')}; simkv {ours if isinstance(ours, str) else 'ran'}"]
                refused += both
                print(f"case {i}: {items_summary(frame)}, budget {opts['max_num_batched_tokens']}: "
                      + ("refused by both" if both else "; ".join(diff)), flush=True)
            else:
                diff = differences(prefix, ours)
                s = ours.summary
                print(f"case {i}: {len(frame)} requests, {items_summary(frame)}, {s['num_steps']} steps, "
                      f"{s['num_preemptions']} preemptions, {s['prefix_cache_hits_tokens']} hit tokens: "
                      + ("equal" if not diff else "; ".join(diff) + f" -- {opts}"), flush=True)
                if not diff and a.record:
                    score = record_score(frame, opts, a.async_scheduling, ours, prefix)
                    case = recorded(frame, opts, a.async_scheduling, prefix)
                    case["trace"] |= {c: [[int(x) for x in v] for v in frame[c]] for c in MM_COLUMNS}
                    saved.append((score, i, case))
            if diff:
                failed += 1
                keep = Path(a.keep) / f"seed{a.seed}_case{i}"
                keep.mkdir(parents=True, exist_ok=True)
                write_oracle_trace(frame, keep / "trace.parquet")
                (keep / "options.json").write_text(json.dumps(opts | {"async_scheduling": a.async_scheduling}, indent=1))
                for f in prefix.parent.glob(prefix.name + ".*"):
                    shutil.copy(f, keep)
    if a.record:
        flags = " --async-scheduling" * a.async_scheduling + " --disable-chunked-mm-input" * a.disable_chunked_mm_input
        saved.sort(key=lambda x: (-x[0], x[1]))
        if a.record_cases:
            wanted = {int(i) for i in a.record_cases.split(",")}
            chosen = [x for x in sorted(saved, key=lambda x: x[1]) if x[1] in wanted]
            why = "as chosen (--record-cases)"
        else:
            chosen = sorted(saved[:a.record_count], key=lambda x: x[1])
            why = "the equal ones that need their items most (record_score)"
        source = (f"scripts/oracle_mm.py --cases {a.cases} --seed {a.seed}{flags} (vLLM 0.33): cases "
                  f"{[i for _, i, _ in chosen]}, {why}")
        out = {"source": source, "cases": [c for _, _, c in chosen]}
        if a.record_append and a.record.exists():
            old = json.loads(a.record.read_text())
            out = {"source": old["source"] + "; " + source, "cases": old["cases"] + out["cases"]}
        a.record.write_text(json.dumps(out) + "\n")
    print(f"{a.cases - failed} of {a.cases} cases equal ({refused} refused by both; vLLM side {vllm_s:.0f} s, "
          f"total {time.time() - started:.0f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
