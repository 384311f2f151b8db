"""Sliding-window models under async scheduling, against the real vLLM scheduler.

vLLM 0.33's `AsyncScheduler` with a two-deep batch queue, as `EngineCore.step_with_batch_queue`
runs it (the time mode of ../shared/tools/vllm_oracle, patched here to build the KV-cache groups
simkv forms for the case's model and its prefix-cache retention interval), against simkv's replay
with `--async-scheduling`. Steps last 1 s on both sides; random small traces (oracle_fuzz.py's:
small pools that preempt, shared prompt content, priorities, watermarks, chunked prefill on and
off) on random sliding-window layouts (windows of 2 to 40 tokens, one to seven groups,
retention 0, none or periodic; with --linear, oracle_linear.py's models with linear-attention
layers instead). Every step's scheduled tokens, running and waiting requests and
blocks in use (all groups), every request's first-token and finish time, the steps, preemptions
and prefix-hit tokens must be equal (oracle_fuzz.differences).

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_hybrid_async.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 50
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from oracle_compare import _patched_oracle  # (scripts/ is on sys.path when run as a script)
from oracle_fuzz import differences, make_case, run_oracle
from simkv.capacity import group_blocks_per_request
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.traces.schema import read_trace, write_trace

_GROUPS_OLD = """        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=a.block_size, num_kv_heads=1,
                                  head_size=1, dtype=torch.float32),
            )
        ],
    )"""
_GROUPS_NEW = """        kv_cache_groups=_simkv_groups(a.block_size, torch),
        prefix_cache_retention_interval=_simkv_retention(),
    )
    vllm_config.cache_config.prefix_cache_retention_interval = _simkv_retention()
    if _simkv_hybrid().get("align"):
        vllm_config.cache_config.mamba_cache_mode = 'align'"""
_HELPERS = '''
def _simkv_hybrid():
    import json as _json
    import os as _os
    return _json.loads(_os.environ["SIMKV_HYBRID"])


def _simkv_retention():
    return _simkv_hybrid()["retention"]


def _simkv_groups(block_size, torch):
    """simkv's KV-cache groups (0: full attention, w: a sliding window of w tokens, or with
    "chunked" an attention chunk of w tokens; where "linear" says so, a Mamba group)."""
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroupSpec,
                                            SlidingWindowSpec)
    from vllm.v1.kv_cache_interface import MambaSpec
    groups = []
    chunked = _simkv_hybrid().get("chunked", False)
    linear = _simkv_hybrid().get("linear") or []
    for i, window in enumerate(_simkv_hybrid()["windows"]):
        kw = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        if i < len(linear) and linear[i] and _simkv_hybrid().get("align"):  # (with prefix caching: states
            # in blocks of the attention block size; with checkpoints the prefill exports one inside a chunk)
            checkpoints = _simkv_hybrid()["checkpoints"]
            spec = MambaSpec(block_size=block_size, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align",
                             num_prefill_checkpoint_blocks=int(checkpoints),
                             prefill_checkpoint_alignment=block_size if checkpoints else None)
        elif i < len(linear) and linear[i]:  # (a Mamba group without prefix caching: a state block per request)
            spec = MambaSpec(block_size=_simkv_hybrid()["max_model_len"], shapes=((1,),), dtypes=(torch.float32,),
                             mamba_cache_mode="none")
        elif not window:
            spec = FullAttentionSpec(**kw)
        elif chunked:
            spec = ChunkedLocalAttentionSpec(attention_chunk_size=window, **kw)
        else:
            spec = SlidingWindowSpec(sliding_window=window, **kw)
        groups.append(KVCacheGroupSpec([f"layer{i}"], spec))
    return groups

'''


def hybrid_oracle(tmp: Path) -> Path:
    """The async-patched oracle, building its KV-cache groups from $SIMKV_HYBRID."""
    path = _patched_oracle(tmp)
    text = path.read_text()
    if text.count(_GROUPS_OLD) != 1:
        raise SystemExit(f"{path}: the KV-cache group lines to patch were not found; the oracle changed")
    text = text.replace(_GROUPS_OLD, _GROUPS_NEW)
    # (the scheduler's block size is the groups' LCM: vLLM's resolve_kv_cache_block_sizes)
    lcm_old = "        block_size=a.block_size,\n        log_stats=True,"
    if text.count(lcm_old) != 1:
        raise SystemExit(f"{path}: the scheduler's block size line to patch was not found; the oracle changed")
    text = text.replace(lcm_old, "        block_size=__import__('math').lcm(*(g.kv_cache_spec.block_size for g in "
                                 "kv_cache_config.kv_cache_groups)),\n        log_stats=True,")
    anchor = "def build_scheduler("
    path.write_text(text.replace(anchor, _HELPERS + anchor, 1))
    return path


def sliding_case(rng: np.random.Generator, chunked: bool = False):
    frame, opts = make_case(rng)
    opts["model"] = str(rng.choice(["tiny-llama", "llama-3-8b", "gemma-2-9b"]))
    opts["sliding_window"] = int(rng.choice([2, 3, 5, 8, 16, 17, 33, 40]))
    opts["full_attention_interval"] = int(rng.choice([0, 2, 3, 6]))
    retention = rng.choice(["zero", "zero", "dense", "periodic"])
    opts["prefix_cache_retention_interval"] = (None if retention == "dense" else
                                               opts["block_size"] * int(rng.integers(1, 9)) if retention == "periodic"
                                               else 0)
    if chunked:  # chunked local attention (Llama 4's): the window is the chunk, some full layers
        opts["attention_chunk_size"] = opts.pop("sliding_window")
        opts["full_attention_interval"] = 2 if opts["model"] == "tiny-llama" else int(rng.choice([2, 3, 6]))
        opts["prefix_cache_retention_interval"] = 0
    config = EngineConfig.from_flat(opts | {"async_scheduling": True})
    fits = group_blocks_per_request(config, opts["max_model_len"], startup=True) + 1
    opts["num_gpu_blocks"] = max(opts["num_gpu_blocks"], fits) + int(rng.integers(0, 60))
    return frame, opts, list(config.kv_cache_groups.windows)


def linear_case(rng: np.random.Generator, align: bool = False):
    """A case on a small model with linear-attention layers (scripts/oracle_linear.py's), prefix
    caching off (vLLM's mamba_cache_mode "none"), or with `align` on (mode "align": chunked
    prefill, a random prefill backend and retention)."""
    from oracle_linear import MODELS, prefix_caching_options

    frame, opts = make_case(rng)
    opts["model"] = str(rng.choice(MODELS))
    opts["block_size"] = int(rng.choice([16, 32]))
    prefix_caching_options(rng, opts, align)
    config = EngineConfig.from_flat(opts | {"async_scheduling": True})
    opts["block_size"] = config.cache.block_size  # (FlashInfer's prefill checkpoints align it to 64)
    fits = group_blocks_per_request(config, opts["max_model_len"], startup=True) + 1
    opts["num_gpu_blocks"] = fits + int(rng.integers(0, 40))
    return frame, opts, list(config.kv_cache_groups.windows)


def recorded(frame, opts: dict, prefix: Path) -> dict:
    """A case and vLLM's results, as tests/core/test_kv_cache_coordinator.py replays them."""
    import csv

    with open(f"{prefix}.steps.csv") as f:
        steps = [[int(r["num_scheduled_tokens"]), int(r["num_running"]), int(r["num_waiting"]),
                  int(r["kv_blocks_used"])] for r in csv.DictReader(f)]
    with open(f"{prefix}.requests.csv") as f:
        rows = list(csv.DictReader(f))
    summary = json.loads(Path(f"{prefix}.summary.json").read_text())
    return {"opts": opts, "trace": json.loads(frame.to_json(orient="records")),
            "vllm": {"steps": steps, "num_steps": summary["total_steps"],
                     "preemptions": sum(int(r["num_preemptions"]) for r in rows),
                     "prefix_hit_tokens": summary["prefix_cache"]["hits_all"],
                     "requests": {r["row"]: [float(r["first_token_time_s"]), float(r["finish_time_s"])]
                                  for r in rows if r["first_token_time_s"] != ""}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle-python", required=True)
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunked", action="store_true", help="chunked local attention instead of sliding windows")
    ap.add_argument("--linear", action="store_true",
                    help="linear-attention models (Mamba groups, prefix caching off) instead of sliding windows")
    ap.add_argument("--align", action="store_true",
                    help="with --linear: prefix caching on (vLLM's mamba_cache_mode 'align')")
    ap.add_argument("--save", type=Path, help="write the N equal cases with the most preemptions, and vLLM's "
                                               "results, to this JSON file (tests/core/data/)")
    ap.add_argument("--save-count", type=int, default=8)
    args = ap.parse_args()
    saved: list[tuple[int, dict]] = []
    rng = np.random.default_rng(args.seed)
    failed = skipped = 0
    totals = dict(requests=0, steps=0, preemptions=0, hits=0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        oracle = hybrid_oracle(tmp)
        for case in range(args.cases):
            frame, opts, windows = linear_case(rng, args.align) if args.linear else sliding_case(rng, args.chunked)
            try:
                config = EngineConfig.from_flat(opts | {"async_scheduling": True})
            except ConfigError as exc:
                print(f"case {case}: skipped ({exc})")
                skipped += 1
                continue
            trace = tmp / f"case{case}.parquet"
            write_trace(frame, trace)
            os.environ["SIMKV_HYBRID"] = json.dumps({"windows": windows, "chunked": config.kv_cache_groups.chunked,
                                                     "retention": opts.get("prefix_cache_retention_interval", 0),
                                                     "linear": [g.linear for g in config.kv_cache_groups.groups],
                                                     "max_model_len": opts["max_model_len"],
                                                     "align": config.mamba_align,
                                                     "checkpoints": config.mamba_prefill_checkpoints})
            run_oracle(args.oracle_python, oracle, trace, opts, tmp / f"o{case}", True)
            res = replay(read_trace(trace), config, "linear", {"step_base_s": 1.0, "step_per_token_s": 0.0})
            diff = differences(tmp / f"o{case}", res)
            s = res.summary
            totals["requests"] += len(frame)
            totals["steps"] += s["num_steps"]
            totals["preemptions"] += s["num_preemptions"]
            totals["hits"] += s["prefix_cache_hits_tokens"]
            if diff:
                failed += 1
                print(f"case {case} groups {windows}: " + "; ".join(diff) + f" -- {opts}", flush=True)
            elif args.save:
                saved.append((s["num_preemptions"], recorded(frame, opts, tmp / f"o{case}")))
    if args.save:
        saved.sort(key=lambda x: -x[0])
        args.save.write_text(json.dumps([case for _, case in saved[:args.save_count]], indent=None) + "\n")
    done = args.cases - skipped
    print(f"{done - failed} of {done} cases equal ({totals['requests']} requests, {totals['steps']} steps, "
          f"{totals['preemptions']} preemptions, {totals['hits']} prefix-hit tokens)")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
