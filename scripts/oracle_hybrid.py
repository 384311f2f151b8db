"""Sliding-window models under vLLM's hybrid KV-cache manager, step by step against the real
vLLM scheduler.

vLLM 0.33's `Scheduler` (../shared/tools/vllm_oracle's venv) is built with the KV-cache groups
simkv forms for a small model with sliding-window layers (core/kv_cache_groups.py): full
attention and sliding-window groups over one pool, in simkv's order. simkv's `Scheduler` runs
the same random cases (windows of 2 to 40 tokens, one to seven groups, small pools, shared prompt
content, priorities, watermarks, chunked prefill on and off, prefix-cache retention intervals 0,
none and periodic; with --speculative, ngram or EAGLE speculative decoding in 60 % of them, the
EAGLE layer in the groups). Every step's scheduled tokens, running and waiting requests and
blocks in use (all groups), every request's first-token and finish step, and the prefix cache's
queried and hit tokens must be equal.

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_hybrid.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 50
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
import oracle_spec  # noqa: E402  (the step loop on both sides)
import oracle_vllm  # noqa: E402


def make_case(rng, speculative: bool = False, methods=("ngram", "eagle"), async_scheduling: bool = False,
              chunked: bool = False, replies: bool = False, pipeline_parallel_size: int = 1) -> dict:
    block_size = int(rng.choice([2, 4, 8, 16]))
    max_model_len = int(rng.choice([64, 128, 256]))
    requests = oracle_spec.random_requests(rng, max_model_len, 0.7)
    sys.path.insert(0, str(ROOT))
    from oracle_fuzz import random_engine_options  # (simkv's side only: it imports simkv)
    from simkv.config import EngineConfig

    opts = random_engine_options(rng, block_size, max_model_len)
    opts["scheduler_reserve_full_isl"] = bool(rng.random() < 0.7)
    # tiny-llama has 2 layers: a mixed model needs more, so the layer pattern comes from a model
    # spec with more layers (its windows overridden)
    opts["model"] = str(rng.choice(["tiny-llama", "llama-3-8b", "gemma-2-9b"]))
    opts["sliding_window"] = int(rng.choice([2, 3, 5, 8, 16, 17, 33, 40]))
    opts["full_attention_interval"] = int(rng.choice([0, 2, 3, 6]))
    retention = rng.choice(["zero", "zero", "dense", "periodic"])  # vLLM's prefix_cache_retention_interval
    opts["prefix_cache_retention_interval"] = (None if retention == "dense" else
                                               block_size * int(rng.integers(1, 9)) if retention == "periodic" else 0)
    if chunked:  # chunked local attention (Llama 4's): chunks of 2 to 40 tokens, some full layers
        opts["attention_chunk_size"] = int(opts.pop("sliding_window"))
        opts["full_attention_interval"] = 2 if opts["model"] == "tiny-llama" else int(rng.choice([2, 3, 6]))
        opts["prefix_cache_retention_interval"] = 0
    from simkv.capacity import group_blocks_per_request

    if speculative and rng.random() < 0.6:  # ngram drafts (no KV of their own) or an EAGLE layer
        oracle_vllm.random_spec_options(rng, opts)
        opts["speculative_method"] = str(rng.choice(list(methods)))
        opts.pop("spec_draft_model", None)
    if async_scheduling:  # (before the pool is sized: the admission cap counts two batches in flight)
        opts["async_scheduling"] = True
    if pipeline_parallel_size > 1:  # (and pipeline stages count their batches in flight too; a stage a layer at most)
        from simkv.specs import get_model_spec

        opts["pipeline_parallel_size"] = min(pipeline_parallel_size, get_model_spec(opts["model"]).num_layers)
    config = EngineConfig.from_flat(opts)
    # a pool where a max_model_len request fits (simkv refuses smaller ones at start-up, as vLLM does)
    fits = group_blocks_per_request(config, max_model_len, startup=True) + 1
    opts["num_gpu_blocks"] = max(opts["num_gpu_blocks"], fits) + int(rng.integers(0, 60))
    # (with EAGLE, the groups hold its draft layer too: vLLM buckets it with the full-attention layers)
    case = {"opts": opts, "requests": requests, "group_windows": list(config.kv_cache_groups.windows),
            "group_chunked": config.kv_cache_groups.chunked}
    if replies:  # (chat sessions whose next turns repeat the replies; after the other draws)
        case["requests"] = oracle_vllm.reply_sessions(rng, max_model_len)
        case["replies"] = True
        oracle_vllm.after_previous_turns(case, oracle_spec.run_simkv)
    return case


def main() -> None:
    a = oracle_vllm.oracle_args(__doc__.split("\n\n")[0], speculative_flag=True, chunked_flag=True, replies_flag=True,
                                aborts_flag=True, parallel_flag=True, mtp_modules_flag=True)
    if oracle_vllm.serve_vllm_side(a, oracle_spec.run_vllm):
        return
    import numpy as np
    rng = np.random.default_rng(a.seed)
    cases = [make_case(rng, a.speculative, chunked=a.chunked, replies=a.replies) for _ in range(a.cases)]
    oracle_vllm.option_cases(a, cases)
    oracle_vllm.parallel_cases(a, rng, cases)
    if a.aborts:  # (a front end aborts some requests: clients that gave up)
        for case in cases:
            case["aborts"] = oracle_vllm.random_aborts(rng, case["requests"])
    theirs = oracle_vllm.vllm_results(str(Path(__file__).parent / "oracle_spec.py"), cases, a)
    oracle_spec.compare_cases(cases, theirs, lambda case: f" groups {case['group_windows']}")


if __name__ == "__main__":
    main()
