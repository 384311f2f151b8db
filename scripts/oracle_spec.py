"""Speculative decoding in the engine core, step by step against the real vLLM scheduler.

vLLM 0.33's `Scheduler` (../shared/tools/vllm_oracle's venv) is built with a speculative
config (ngram, eagle or draft_model, with the oracle's config-only model as the draft) and fed
the model runner's side by hand: after each step every request that sampled gets 1 + accepted
tokens, and the drafter's K proposals go in through `update_draft_token_ids`, as the engine core
does. How many drafts are accepted comes from simkv's own `AcceptanceModel` (imported on both
sides), so both schedulers see the same acceptances. simkv's `Scheduler` runs the same random
cases (small pools, shared prompt content, priorities, watermarks, chunked prefill on and off,
budgets that cut drafts, dynamic speculation lengths). Every step's scheduled tokens, running and waiting requests and
blocks in use, and every request's first-token and finish step, must be equal.

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_spec.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 50
    .venv/bin/python scripts/oracle_spec.py --aborts --cases 50 --seed 2   # a front end aborts some requests
    .venv/bin/python scripts/oracle_spec.py --parallel [--max-n 14]   # rows for n sequences, fanned out
    .venv/bin/python scripts/oracle_spec.py --ngram-misses --model-runner v1   # lookups without a match: no drafts
    .venv/bin/python scripts/oracle_spec.py --ngram-misses   # vLLM's V2 runner (its default): K drafts, all rejected
    .venv/bin/python scripts/oracle_spec.py --suffix   # suffix decoding: proposals of any length up to K
    .venv/bin/python scripts/oracle_spec.py --parallel-drafting   # vLLM's parallel_drafting (EAGLE, draft model)
    .venv/bin/python scripts/oracle_spec.py --dflash   # a DFlash drafter (K + 1 lookahead slots) in every case
    .venv/bin/python scripts/oracle_spec.py --images [--disable-chunked-mm-input] [--method eagle] [--mtp-modules 3]
        # image items in the prompts (oracle_mm.py's content), vLLM's encoder budget and cache

--parallel (here and in oracle_hybrid.py, oracle_linear.py, oracle_spec_async.py and
oracle_offload.py): about a third of the rows ask for 2 to --max-n sequences; vLLM gets each
row's n requests one after the other, named as its front end names a parent's children
(`k_row`) with the parent's arrival time, simkv fans the row out (oracle_vllm.sample_ids). A
row's first token is its first member's, its finish its last member's. A run that livelocks in
both (members of one group preempting each other under the priority policy) is compared up to
where simkv's LivelockError stopped it.

--images (here and in oracle_spec_async.py): every case's prompts are redrawn, from a generator of
their own, as scripts/oracle_mm.py draws them (arrivals, outputs, priorities and options stay the
seed's): prefixes of three streams of text blocks and image segments (an item's identifier a hash
of the content it covers: equal content, equal items, so both sides find the same prefix hits),
images recurring across and within streams, prompts that end at an item's start or end, and rows
of unique tokens with items of their own; item lengths 1 to 2 x max_num_batched_tokens (16 to 128
with chunked prefill), mm_max_tokens_per_item the largest item or above it in a third of the
cases. vLLM's scheduler gets the encoder budget and cache of compute_mm_encoder_budget and each
request one MultiModalFeatureSpec per item (oracle_vllm.mm_budget, mm_features), simkv's the
options mm_max_tokens_per_item and disable_chunked_mm_input and each request its mm_items.
--disable-chunked-mm-input: in every case, its items within the token budget and the long-prefill
threshold. --method M: every speculative case's method is M (ngram, eagle, eagle3, mtp, draft_model).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
import oracle_vllm  # noqa: E402  (the vLLM side both step-mode oracles share)
from oracle_pd import _step_loop, differences  # noqa: E402  (shared with the P/D oracle)


def random_requests(rng, max_model_len: int, share_probability: float) -> list[dict]:
    """3 to 39 requests arriving over 30 steps; with `share_probability`, prompts drawn from three
    shared contents (8-token hash blocks)."""
    n = int(rng.integers(3, 40))
    prefixes = [[int(x) for x in rng.integers(0, 4, 40)] for _ in range(3)] if rng.random() < share_probability else None
    requests = []
    for i in range(n):
        prompt = int(rng.integers(1, max_model_len))
        r = {"row": i, "arrival_step": int(rng.integers(0, 30)), "prompt": prompt,
             "output": int(rng.integers(1, 50)), "priority": int(rng.integers(0, 3))}
        if prefixes is not None:
            r["block_hashes"] = prefixes[int(rng.integers(0, 3))][:-(-prompt // 8)]
        requests.append(r)
    requests.sort(key=lambda r: (r["arrival_step"], r["row"]))
    return requests


def make_case(rng, aborts: bool = False) -> dict:
    block_size = int(rng.choice([4, 8, 16]))
    max_model_len = int(rng.choice([64, 128, 256]))
    requests = random_requests(rng, max_model_len, 0.6)
    from oracle_fuzz import random_engine_options  # (simkv's side only: it imports simkv)

    opts = random_engine_options(rng, block_size, max_model_len)
    opts["scheduler_reserve_full_isl"] = bool(rng.random() < 0.7)
    oracle_vllm.random_spec_options(rng, opts)
    if rng.random() < 0.3:  # dynamic speculation: drafts by the step's number of requests
        cuts = sorted({int(x) for x in rng.integers(2, 12, 2)})
        starts = [1] + cuts
        ends = [c - 1 for c in cuts] + [int(rng.choice([16, 64]))]
        opts["spec_tokens_per_batch_size"] = ",".join(
            f"{a}-{b}:{int(rng.integers(0, 6))}" for a, b in zip(starts, ends))
    case = {"opts": opts, "requests": requests}
    if aborts:
        case["aborts"] = oracle_vllm.random_aborts(rng, requests)
    return case


IMAGES_SEED = 104_729  # (--images: the content's generator, a.seed + this)


def method_cases(a, cases: list[dict]) -> None:
    """--method M: every speculative case's method is M (a draft model's name for draft_model)."""
    method = getattr(a, "method", None)
    if not method:
        return
    for case in cases:
        opts = case["opts"]
        if not opts.get("speculative_method"):
            continue
        opts["speculative_method"] = method
        opts.pop("spec_draft_model", None)
        if method == "draft_model":
            opts["spec_draft_model"] = "tiny-llama"
        if method != "ngram":
            opts.pop("spec_ngram_match_rate", None)


def image_cases(a, cases: list[dict]) -> None:
    """--images: each case's prompts redrawn with image items (`with_images`), from a generator of
    their own (the arrivals, outputs, priorities and options are those of the seed without it)."""
    if not getattr(a, "images", False):
        return
    import numpy as np

    rng = np.random.default_rng(a.seed + IMAGES_SEED)
    for case in cases:
        with_images(rng, case, getattr(a, "disable_chunked_mm_input", False))
        if getattr(a, "ec_store", False):  # (half the case's images in the store; an encode instance in half the cases)
            hashes = sorted({h for r in case["requests"] for _, _, h in r["mm"]})
            case["ec_store"] = [h for h in hashes if rng.random() < 0.5]
            case["ec_producer"] = bool(rng.random() < 0.5)
        if getattr(a, "encode_only", False):
            encode_instance(case)


def encode_instance(case: dict) -> None:
    """--encode-only: the case as an encode instance runs it (simkv/replay/encode_pool.py): one
    output token a request (vLLM: none, the request ends once its prompt is consumed), no prefix
    caching, drafts or async scheduling, room for every request (it holds no KV cache), an empty
    store it fills."""
    opts = case["opts"]
    for key in [k for k in opts if k.startswith("spec") or k == "num_speculative_tokens"]:
        del opts[key]
    opts.update(enable_prefix_caching=False, async_scheduling=False)
    opts["num_gpu_blocks"] = opts["max_num_seqs"] * -(-opts["max_model_len"] // opts["block_size"]) + 2
    for r in case["requests"]:
        r["output"] = 1
    case.update(encode_only=True, ec_store=[], ec_producer=True)


def with_images(rng, case: dict, disable_chunked: bool) -> None:
    """A case's prompts as scripts/oracle_mm.py draws them: prefixes of three streams of text blocks
    and image segments (most rows, in 80 % of the cases) or unique tokens with items of their own;
    with chunked prefill a small token budget (16 to 128, so that items of up to twice it and the
    encoder budget bite); mm_max_tokens_per_item the largest item or above it; the rows' items in
    `r["mm"]` and the encoder options in case["mm"] (vLLM's side) and the options (simkv's)."""
    from oracle_mm import item_cap, make_images, make_stream, stream_row, unique_row

    opts = case["opts"]
    max_model_len = opts["max_model_len"]
    k = opts.get("num_speculative_tokens", 0)
    floor = max(opts["max_num_seqs"], k + (2 if opts.get("speculative_method") == "dflash" else 1))
    if opts["enable_chunked_prefill"]:
        opts["max_num_batched_tokens"] = max(int(rng.choice([16, 32, 64, 128])), floor)
        if opts.get("max_num_scheduled_tokens"):
            opts["max_num_scheduled_tokens"] = min(opts["max_num_scheduled_tokens"], opts["max_num_batched_tokens"])
    budget = opts["max_num_batched_tokens"]
    cap = item_cap(opts, max_model_len, disable_chunked)
    images = make_images(rng, budget, cap)
    streams = [make_stream(rng, s, images, max_model_len) for s in range(3)]
    shared = rng.random() < 0.8
    for r in case["requests"]:
        if shared and rng.random() < 0.75:
            prompt, ids, items = stream_row(rng, *streams[int(rng.integers(0, 3))], max_model_len)
        else:
            prompt, ids, items = unique_row(rng, r["row"], budget, cap, max_model_len)
        r["prompt"] = prompt
        r.pop("block_hashes", None)
        if ids:
            r["block_hashes"] = [int(x) for x in ids]
        r["mm"] = [[int(o), int(n), int(h)] for o, n, h in items]
    largest = max((n for r in case["requests"] for _, n, _ in r["mm"]), default=0)
    most = largest or 1
    if rng.random() < 0.33:
        more = int(rng.integers(1, budget + 1))
        most = min(most + more, budget) if disable_chunked else most + more
    opts["mm_max_tokens_per_item"] = most
    opts["disable_chunked_mm_input"] = disable_chunked
    case["mm"] = {"max_tokens_per_item": most, "disable_chunked_mm_input": disable_chunked}


# ---- vLLM side (runs in the oracle's venv) --------------------------------------------------------
def run_vllm(case: dict) -> dict:
    from vllm.v1.outputs import ModelRunnerOutput

    o = case["opts"] | {"group_windows": case.get("group_windows"),  # (oracle_hybrid.py's cases have groups)
                        "group_chunked": case.get("group_chunked", False),
                        "group_linear": case.get("group_linear"),  # (oracle_linear.py's: Mamba groups)
                        "mamba_cache_mode": case.get("mamba_cache_mode"),
                        "mamba_prefill_checkpoints": case.get("mamba_prefill_checkpoints")}
    sched, vllm_config = oracle_vllm.build_scheduler(o, o.get("scheduler_reserve_full_isl", True))
    oracle_vllm.mm_budget(sched, vllm_config, case.get("mm"))  # (--images)
    store = oracle_vllm.ec_store(sched, case)  # (--ec-store, --encode-only)
    encode_only = bool(case.get("encode_only"))
    if encode_only:  # (vLLM's mm_encoder_only: no language model, a request ends once its prompt is consumed)
        sched.is_mm_encoder_only = True
    if case.get("replies"):  # (the fake model samples the replies' content: --replies)
        oracle_vllm.sample_reply_content(case)
    hasher = oracle_vllm.block_hasher(vllm_config, o["block_size"])
    pool = sched.kv_cache_manager.block_pool
    usable = pool.num_gpu_blocks - 1
    accept = oracle_vllm.acceptance(o)
    first_token, finish = {}, {}
    accepted_total = [0]
    prefix = [0, 0]  # tokens queried, hit

    ids_of = oracle_vllm.sample_ids(case["requests"])  # (--parallel: a row's n requests)

    aborts = case.get("aborts", [])

    def step(step_index, arrived):
        for r in arrived:
            for rid in ids_of[r["row"]]:
                sched.add_request(oracle_vllm.vllm_request(r, rid, hasher))
        oracle_vllm.take_aborts(sched, aborts, step_index, "before")
        so = sched.schedule()
        n_running, n_waiting = sched.get_request_counts()
        row = [so.total_num_scheduled_tokens, n_running, n_waiting, usable - pool.get_num_free_blocks()]
        req_ids = list(so.num_scheduled_tokens)
        sampled, accepted = oracle_vllm.sampled_tokens(sched, so, req_ids, accept)
        if encode_only:  # (nothing is sampled)
            sampled = [[] for _ in req_ids]
        oracle_vllm.take_aborts(sched, aborts, step_index, "output")
        if aborts:  # (an aborted request's drafts count for nothing: its output is skipped)
            accepted = sum(len(s) - 1 for rid, s in zip(req_ids, sampled) if s and rid in sched.requests)
        accepted_total[0] += accepted
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        if store is not None:  # (saved by the worker as the step runs)
            store.note_encoded(sched, so)
        oracle_vllm.record_outputs(sched.update_from_output(so, mro), step_index, prefix, first_token, finish)
        if accept is not None:
            oracle_vllm.propose_drafts(sched, so, req_ids, accept)
        return row, not sched.has_requests()

    result = _step_loop(case["requests"], step)
    if encode_only:  # (the answer an encode instance gives is its end: simkv's one output token)
        first_token = dict(finish)
    result["requests"] = oracle_vllm.row_steps(case["requests"], ids_of, first_token, finish)
    result["accepted"] = accepted_total[0]
    result["prefix"] = prefix
    return result


# ---- simkv side -----------------------------------------------------------------------------------
def run_simkv(case: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.core.helpers import drive_steps

    result = drive_steps(case)  # (--images: the rows' "mm" items, tests/core/helpers.py _deliver)
    sched = result.pop("scheduler")
    result["accepted"] = sched.spec_stats["num_accepted_tokens"]
    stats = sched.kv_cache_manager.prefix_cache_stats
    result["prefix"] = [stats.queries, stats.hits]
    return result


def case_differences(theirs: dict, ours: dict) -> list[str]:
    """Steps and requests (oracle_pd.differences), accepted drafts and prefix-cache counts (up
    to the point where simkv stopped a livelock vLLM's run went on with)."""
    diff = differences(theirs, ours)
    if ours.get("error") == "livelock":  # (the totals of a run vLLM went on with: not compared)
        return diff
    if theirs["accepted"] != ours["accepted"]:
        diff.append(f"accepted drafts: vLLM {theirs['accepted']}, simkv {ours['accepted']}")
    if theirs["prefix"] != ours["prefix"]:
        diff.append(f"prefix cache (queried, hit tokens): vLLM {theirs['prefix']}, simkv {ours['prefix']}")
    return diff


def compare_cases(cases: list, theirs: list, label=lambda case: "") -> None:
    """Run simkv's side of the step-mode cases, print each that differs from vLLM's results (with
    `label(case)`) and the totals, and exit 1 if any differs (the step-mode oracles' ending)."""
    failures = 0
    totals = dict(requests=0, steps=0, hits=0, accepted=0, aborted=0, livelocks=0, stuck=0)
    for i, (case, t) in enumerate(zip(cases, theirs)):
        ours = run_simkv(case)
        totals["requests"] += len(case["requests"])
        totals["steps"] += len(t["steps"])
        totals["hits"] += t["prefix"][1]
        totals["accepted"] += t["accepted"]
        totals["aborted"] += ours.get("aborted", 0)
        totals["livelocks"] += ours.get("error") == "livelock"
        totals["stuck"] += ours.get("error") == "stuck"
        diff = case_differences(t, ours) + (oracle_vllm.late_turns(case, t) if case.get("replies") else [])
        if diff:
            failures += 1
            print(f"case {i}{label(case)}: " + "; ".join(diff) + f" -- {case['opts']}")
    print(f"{len(cases) - failures} of {len(cases)} cases equal ({totals['requests']} requests, "
          f"{totals['steps']} steps, {totals['hits']} prefix-hit tokens, {totals['accepted']} drafts accepted"
          + (f", {totals['aborted']} requests aborted" if totals["aborted"] else "")
          + (f"; {totals['livelocks']} livelocked in both, equal until simkv stopped" if totals["livelocks"] else "")
          + (f"; {totals['stuck']} stuck in both (a prompt that never fits a step), equal until then"
             if totals["stuck"] else "")
          + ")")
    sys.exit(1 if failures else 0)


def main() -> None:
    import oracle_vllm

    a = oracle_vllm.oracle_args(__doc__.split("\n\n")[0], aborts_flag=True, parallel_flag=True,
                                ngram_misses_flag=True, parallel_drafting_flag=True, dflash_flag=True,
                                mtp_modules_flag=True, images_flag=True)
    if oracle_vllm.serve_vllm_side(a, run_vllm):
        return
    import numpy as np
    rng = np.random.default_rng(a.seed)
    cases = [make_case(rng, a.aborts) for _ in range(a.cases)]
    if a.ngram_misses:  # (drawn after the cases: without the flag a seed gives the same cases)
        for case in cases:
            oracle_vllm.ngram_miss_drafter(rng, case["opts"])
    if a.suffix:  # (likewise)
        for case in cases:
            oracle_vllm.suffix_drafter(rng, case["opts"])
    method_cases(a, cases)  # (--method; before the drafter flags, which may replace it)
    oracle_vllm.option_cases(a, cases)
    oracle_vllm.parallel_cases(a, rng, cases)
    image_cases(a, cases)  # (--images: after the options, whose token budget sizes the items)
    compare_cases(cases, oracle_vllm.vllm_results(__file__, cases, a))


if __name__ == "__main__":
    main()
