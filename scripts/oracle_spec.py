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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORACLE_DIR = ROOT.parent / "shared" / "tools" / "vllm_oracle"
sys.path.insert(0, str(Path(__file__).parent))
from oracle_pd import _step_loop, differences  # noqa: E402  (shared with the P/D oracle)

METHODS = ("ngram", "eagle", "draft_model")


def make_case(rng) -> dict:
    block_size = int(rng.choice([4, 8, 16]))
    max_model_len = int(rng.choice([64, 128, 256]))
    n = int(rng.integers(3, 40))
    prefixes = [[int(x) for x in rng.integers(0, 4, 40)] for _ in range(3)] if rng.random() < 0.6 else None
    requests = []
    for i in range(n):
        prompt = int(rng.integers(1, max_model_len))
        r = {"row": i, "arrival_step": int(rng.integers(0, 30)), "prompt": prompt,
             "output": int(rng.integers(1, 50)), "priority": int(rng.integers(0, 3))}
        if prefixes is not None:
            r["block_hashes"] = prefixes[int(rng.integers(0, 3))][:-(-prompt // 8)]
        requests.append(r)
    requests.sort(key=lambda r: (r["arrival_step"], r["row"]))
    from oracle_fuzz import random_engine_options  # (simkv's side only: it imports simkv)

    opts = random_engine_options(rng, block_size, max_model_len)
    opts["scheduler_reserve_full_isl"] = bool(rng.random() < 0.7)
    opts["speculative_method"] = str(rng.choice(METHODS))
    opts["num_speculative_tokens"] = int(rng.choice([1, 2, 3, 5]))
    opts["spec_acceptance_rate"] = float(rng.choice([0.0, 0.5, 0.8, 1.0]))
    opts["spec_seed"] = int(rng.integers(0, 1000))
    if opts["speculative_method"] == "draft_model":
        opts["spec_draft_model"] = "tiny-llama"
    opts["max_num_batched_tokens"] = max(opts["max_num_batched_tokens"], opts["num_speculative_tokens"] + 1)
    if rng.random() < 0.3:  # dynamic speculation: drafts by the step's number of requests
        cuts = sorted({int(x) for x in rng.integers(2, 12, 2)})
        starts = [1] + cuts
        ends = [c - 1 for c in cuts] + [int(rng.choice([16, 64]))]
        opts["spec_tokens_per_batch_size"] = ",".join(
            f"{a}-{b}:{int(rng.integers(0, 6))}" for a, b in zip(starts, ends))
    return {"opts": opts, "requests": requests}


# ---- vLLM side (runs in the oracle's venv) --------------------------------------------------------
def run_vllm(case: dict) -> dict:
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    import oracle
    sys.path.insert(0, str(ROOT))
    from simkv.core.spec_decode import AcceptanceModel

    o = case["opts"]
    k = o["num_speculative_tokens"]
    fake = oracle.ensure_fake_model(str(ORACLE_DIR / "fake_model"))
    model_config = ModelConfig(model=fake, dtype="float16", seed=0, skip_tokenizer_init=True,
                               max_model_len=o["max_model_len"])
    method = o["speculative_method"]
    spec_kw = dict(method=method, num_speculative_tokens=k)
    if o.get("spec_tokens_per_batch_size"):
        spec_kw["num_speculative_tokens_per_batch_size"] = [
            [int(x) for x in part.replace(":", "-").split("-")] for part in o["spec_tokens_per_batch_size"].split(",")]
    if method == "ngram":
        spec_kw.update(prompt_lookup_max=3, prompt_lookup_min=1)
    else:
        spec_kw.update(model=fake)
    spec = SpeculativeConfig(target_model_config=model_config, target_parallel_config=ParallelConfig(), **spec_kw)
    scheduler_config = SchedulerConfig(
        max_num_seqs=o["max_num_seqs"], max_num_batched_tokens=o["max_num_batched_tokens"],
        max_model_len=o["max_model_len"], enable_chunked_prefill=o["enable_chunked_prefill"],
        long_prefill_token_threshold=o["long_prefill_token_threshold"], is_encoder_decoder=False,
        policy=o["scheduling_policy"], watermark=o["watermark"],
        scheduler_reserve_full_isl=o["scheduler_reserve_full_isl"], disable_hybrid_kv_cache_manager=True)
    cache_config = CacheConfig(block_size=o["block_size"], enable_prefix_caching=o["enable_prefix_caching"])
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"),
                             speculative_config=spec)
    for key in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"):
        setattr(vllm_config.scheduler_config, key, o[key])
    vllm_config.scheduler_config.async_scheduling = False
    vllm_config.cache_config.enable_prefix_caching = o["enable_prefix_caching"]
    vllm_config.cache_config.num_gpu_blocks = o["num_gpu_blocks"]
    kv_cache_config = KVCacheConfig(num_blocks=o["num_gpu_blocks"], kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=o["block_size"], num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=o["block_size"],
                      log_stats=True, structured_output_manager=StructuredOutputManager(vllm_config))
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(o["block_size"], hash_fn, vllm_config.num_hash_lookahead_tokens)
    pool = sched.kv_cache_manager.block_pool
    usable = pool.num_gpu_blocks - 1
    accept = AcceptanceModel(tuple([o["spec_acceptance_rate"]] * k), o["spec_seed"])
    first_token, finish = {}, {}
    accepted_total = [0]

    def make(r):
        tr = {"prompt_tokens": r["prompt"], "prefix_group": None, "row": r["row"],
              "block_hashes": r.get("block_hashes"), "hash_block_tokens": 8}
        ids = oracle.make_prompt_ids(tr, 0, 0, {})
        sp = SamplingParams(max_tokens=r["output"], ignore_eos=True, temperature=0.0)
        return Request(request_id=str(r["row"]), prompt_token_ids=ids, sampling_params=sp, pooling_params=None,
                       arrival_time=r["arrival_step"] + r["row"] * 1e-9, priority=r["priority"],
                       block_hasher=block_hasher)

    def step(step_index, arrived):
        for r in arrived:
            sched.add_request(make(r))
        so = sched.schedule()
        n_running, n_waiting = sched.get_request_counts()
        row = [so.total_num_scheduled_tokens, n_running, n_waiting, usable - pool.get_num_free_blocks()]
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = sched.requests[rid]
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            n_acc = 0
            if drafts and drafts[0] != -1:
                n_acc = accept.num_accepted(int(rid), len(req.output_token_ids), len(drafts))
            accepted_total[0] += n_acc
            base = req.num_prompt_tokens + len(req.output_token_ids)
            sampled.append([oracle.fake_output_token(int(rid), base + j) for j in range(1 + n_acc)])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        for eco in sched.update_from_output(so, mro).values():
            for out in eco.outputs:
                if out.new_token_ids and out.request_id not in first_token:
                    first_token[out.request_id] = step_index
                if out.finish_reason is not None:
                    finish[out.request_id] = step_index
        # the drafter proposes K tokens for every request of the step (vLLM drops those of
        # prefill chunks and finished requests)
        num_drafts = so.num_spec_tokens_to_schedule  # (K, or dynamic speculation's K for this batch)
        sched.update_draft_token_ids(DraftTokenIds(req_ids, [[oracle.fake_output_token(int(rid), 10_000 + j)
                                                             for j in range(num_drafts)] for rid in req_ids]))
        return row, not sched.has_requests()

    result = _step_loop(case["requests"], step)
    result["requests"] = {str(r["row"]): [first_token.get(str(r["row"]), -1), finish.get(str(r["row"]), -1)]
                          for r in case["requests"]}
    result["accepted"] = accepted_total[0]
    return result


# ---- simkv side -----------------------------------------------------------------------------------
def run_simkv(case: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.core.helpers import drive_steps

    result = drive_steps(case)
    result["accepted"] = result.pop("scheduler").spec_stats["num_accepted_tokens"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle-python", default="/tmp/vllm-oracle-venv/bin/python")
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save", type=Path, help="write the cases and vLLM's results to this JSON file")
    ap.add_argument("--vllm-side", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.vllm_side:
        sys.path.insert(0, str(ORACLE_DIR))
        cases = json.loads(Path(a.vllm_side[0]).read_text())
        Path(a.vllm_side[1]).write_text(json.dumps([run_vllm(c) for c in cases]))
        return
    import numpy as np
    rng = np.random.default_rng(a.seed)
    cases = [make_case(rng) for _ in range(a.cases)]
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "cases.json"), Path(tmp, "vllm.json")
        src.write_text(json.dumps(cases))
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent), VLLM_LOGGING_LEVEL="ERROR")
        subprocess.run([a.oracle_python, __file__, "--vllm-side", str(src), str(dst)], check=True, env=env)
        theirs = json.loads(dst.read_text())
    if a.save:
        a.save.write_text(json.dumps([{"case": c, "vllm": t} for c, t in zip(cases, theirs)]))
    failures = 0
    totals = dict(requests=0, steps=0, accepted=0)
    for i, (case, t) in enumerate(zip(cases, theirs)):
        ours = run_simkv(case)
        totals["requests"] += len(case["requests"])
        totals["steps"] += len(t["steps"])
        totals["accepted"] += t["accepted"]
        diff = differences(t, ours)
        if t["accepted"] != ours["accepted"]:
            diff.append(f"accepted drafts: vLLM {t['accepted']}, simkv {ours['accepted']}")
        if diff:
            failures += 1
            print(f"case {i} {case['opts']}: " + "; ".join(diff))
    print(f"{len(cases) - failures} of {len(cases)} cases equal "
          f"({totals['requests']} requests, {totals['steps']} steps, {totals['accepted']} drafts accepted)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
