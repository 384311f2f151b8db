"""Seed article 002's allocator study, expressed with simkv's general options.

The article's own step model (its section 3): 100,000 token slots, max_model_len 4,096, the
req400 workload, one admission per step made before the running requests decode, the sampled
token stored in the step that samples it (num_lookahead_tokens=1), a request that cannot get a
block preempts itself and restarts from its prompt at the head of the queue, a prompt-only
admission check, all blocks usable (no null block), no prefix caching, no token budget. Peak
concurrency and peak blocks are read at the end of each step, as the article does.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from simkv.config import EngineConfig
from simkv.replay.api import replay
from simkv.traces.schema import trace_from_frame
from simkv.traces.synth import lognormal

POOL_SLOTS = 100_000
MAX_MODEL_LEN = 4096
BLOCK_SIZES = (8, 16, 32, 64, 128)
WATERMARKS = (0.0, 0.01, 0.02, 0.05, 0.10)
PREFIXES = (777, 1000, 1500, 3000)
PREFIX_BLOCK_SIZES = (8, 16, 32, 64)


def seed_options(block_size: int = 16, watermark: float = 0.0, allocator: str = "paged") -> dict:
    """The article's step model as flat simkv options (also usable as a --config file)."""
    return dict(
        block_size=block_size, num_gpu_blocks=POOL_SLOTS // block_size, reserve_null_block=False,
        allocator=allocator, enable_prefix_caching=False, watermark=watermark, num_lookahead_tokens=1,
        max_num_admissions_per_step=1, admission_order="before_running", preemption_victim="requester",
        preemption_mode="restart", scheduler_reserve_full_isl=False, max_num_seqs=4096,
        max_num_batched_tokens=1_000_000, max_model_len=MAX_MODEL_LEN)


def vllm_options(block_size: int = 16, watermark: float = 0.0) -> dict:
    """The same pool under vLLM v1's defaults (null block, budget 8,192, 256 sequences)."""
    return dict(block_size=block_size, num_gpu_blocks=POOL_SLOTS // block_size, watermark=watermark,
                max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=MAX_MODEL_LEN)


def _run(options: dict, trace=None) -> dict:
    result = replay(trace if trace is not None else lognormal(), EngineConfig.from_flat(options), "unit")
    steps, s = result.steps, result.summary
    return {
        "peak_concurrency": int((steps["num_running"] - steps["num_finished"]).max()),
        "steps": s["num_steps"],
        "preemptions": s["num_preemptions"],
        "internal_fragmentation_pct": round(s["internal_fragmentation_pct"], 2),
        "peak_blocks_used": int(steps["num_blocks_used_end"].max()),
        "total_blocks": options["num_gpu_blocks"] - (0 if options.get("reserve_null_block") is False else 1),
        "peak_running_after_schedule": s["peak_running"],
        "prefix_cache_hits_tokens": s["prefix_cache_hits_tokens"],
    }


def prefix_cached_tokens(prefix_tokens: int, block_size: int, semantics: str = "seed") -> int:
    """Replay two requests sharing a `prefix_tokens` prefix (content given per token, so any
    block size works) plus 50 tokens of their own; return the second one's prefix-hit tokens."""
    ids = np.arange(prefix_tokens, dtype=np.int64) + 7_000_000
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1000.0], "prompt_tokens": [prefix_tokens + 50] * 2,
                          "output_tokens": [4, 4], "block_hashes": [ids, ids]})
    trace = trace_from_frame(frame, hash_block_tokens=1)
    options = (seed_options if semantics == "seed" else vllm_options)(block_size)
    options = dict(options, enable_prefix_caching=True)
    result = replay(trace, EngineConfig.from_flat(options), "unit")
    return int(result.requests["prefix_hit_tokens"].iloc[1])


def make_tables(semantics: str = "seed") -> dict:
    opts = seed_options if semantics == "seed" else vllm_options
    paged = _run(opts(16))
    tables = {
        "paged": {k: paged[k] for k in ("peak_concurrency", "steps", "preemptions", "internal_fragmentation_pct",
                                         "peak_blocks_used", "total_blocks")},
        "block_size_sweep": [],
        "watermark_sweep": [],
        "prefix_granularity": [],
    }
    if semantics == "seed":
        contiguous = _run(seed_options(16, allocator="contiguous"))
        tables = {"contiguous": {"peak_concurrency": contiguous["peak_concurrency"], "steps": contiguous["steps"]},
                  **tables}
    for b in BLOCK_SIZES:
        row = paged if b == 16 else _run(opts(b))
        tables["block_size_sweep"].append({"block_size": b, **{k: row[k] for k in (
            "peak_concurrency", "internal_fragmentation_pct", "preemptions", "steps")}})
    for w in WATERMARKS:
        row = paged if w == 0.0 else _run(opts(16, w))
        tables["watermark_sweep"].append({"watermark": w, **{k: row[k] for k in ("peak_concurrency", "preemptions", "steps")}})
    for p in PREFIXES:
        for b in PREFIX_BLOCK_SIZES:
            cached = prefix_cached_tokens(p, b, semantics)
            tables["prefix_granularity"].append({"prefix_tokens": p, "block_size": b, "cached_tokens": cached,
                                                 "lost_pct": round(100.0 * (p - cached) / p, 2)})
    return tables
