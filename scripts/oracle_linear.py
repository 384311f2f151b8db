"""Models with linear-attention layers (Gated DeltaNet, Mamba2) under vLLM's hybrid KV-cache
manager, step by step against the real vLLM scheduler.

vLLM 0.33's `Scheduler` (../shared/tools/vllm_oracle's venv) is built with the KV-cache groups
simkv forms for a small hybrid model (tests/core/data/tiny_*.json, Nemotron-H's layout among them:
one to four Mamba groups and a full-attention group over one pool, in simkv's order), its Mamba groups as vLLM runs them without
prefix caching (mamba_cache_mode "none": a MambaSpec of max_model_len-token blocks, one state block
per request). simkv's `Scheduler` runs the same random cases (blocks of 16 or 32 tokens, small
pools, priorities, watermarks, chunked prefill on and off, long-prefill thresholds; with
--speculative, ngram or MTP drafts in 60 % of them: K more state blocks per Mamba group and
request, vLLM's num_speculative_blocks, and the MTP layer in the full-attention group; with
--align too, the scratch state blocks of mode "align" and MTP's lookahead block keys; with --suffix,
suffix decoding in every case: K 4 to 12, K more state blocks, proposals of drawn lengths; with
--ngram-misses, ngram drafts in every case, found at a rate of 0, 0.3 or 0.7). Every
step's scheduled tokens, running and waiting requests and blocks in use (all groups), every
request's first-token and finish step, and the accepted drafts must be equal.

--images (not with --replies): every case's prompts redrawn with image items as
oracle_spec.py --images draws them, vLLM's encoder budget and cache.

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_linear.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 50
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
import oracle_spec  # noqa: E402  (the step loop on both sides)
import oracle_vllm  # noqa: E402

MODELS = ("tests/core/data/tiny_gdn_8x4.json", "tests/core/data/tiny_gdn_4x2.json",
          "tests/core/data/tiny_mamba2_10x5.json", "tests/core/data/tiny_nemotron_h.json")


def prefix_caching_options(rng, opts: dict, align: bool) -> None:
    """vLLM's mamba_cache_mode "none", or with `align` prefix caching ("align": chunked prefill,
    Gated DeltaNet's prefill on FlashInfer's kernel or Triton's, with or without checkpoints
    inside a chunk, and retention 0, None or 128)."""
    opts["enable_prefix_caching"] = align
    if align:
        opts["enable_chunked_prefill"] = True
        opts["gdn_prefill_backend"] = str(rng.choice(["flashinfer", "triton"]))
        opts["prefix_cache_retention_interval"] = [0, None, 128][int(rng.choice([0, 0, 1, 2]))]


def suffix_options(rng, opts: dict) -> None:
    """Random speculative options, then suffix decoding (oracle_vllm.suffix_drafter)."""
    oracle_vllm.random_spec_options(rng, opts)
    oracle_vllm.suffix_drafter(rng, opts)


def ngram_miss_options(rng, opts: dict) -> None:
    """Random speculative options, then ngram drafts with misses (oracle_vllm.ngram_miss_drafter)."""
    oracle_vllm.random_spec_options(rng, opts)
    oracle_vllm.ngram_miss_drafter(rng, opts)


def make_case(rng, speculative: bool = False, align: bool = False, replies: bool = False,
              suffix: bool = False, ngram_misses: bool = False) -> dict:
    block_size = int(rng.choice([16, 32]))
    max_model_len = int(rng.choice([64, 128, 256]))
    requests = oracle_spec.random_requests(rng, max_model_len, 0.7)
    sys.path.insert(0, str(ROOT))
    from oracle_fuzz import random_engine_options  # (simkv's side only: it imports simkv)
    from simkv.capacity import group_blocks_per_request
    from simkv.config import ConfigError, EngineConfig

    opts = random_engine_options(rng, block_size, max_model_len)
    opts["scheduler_reserve_full_isl"] = bool(rng.random() < 0.7)
    opts["model"] = str(rng.choice(MODELS))
    prefix_caching_options(rng, opts, align)
    if suffix:
        suffix_options(rng, opts)
    elif ngram_misses:
        ngram_miss_options(rng, opts)
    elif speculative and rng.random() < 0.6:  # ngram drafts, or an MTP layer (in the full-attention group)
        oracle_vllm.random_spec_options(rng, opts)
        opts["speculative_method"] = str(rng.choice(["ngram", "mtp"]))
        opts.pop("spec_draft_model", None)
    try:
        config = EngineConfig.from_flat(opts)
    except ConfigError:  # (an MTP layer that splits the attention layers in two groups: refused)
        if not opts.get("speculative_method"):
            raise
        opts["speculative_method"] = "ngram"
        config = EngineConfig.from_flat(opts)
    # a pool where a max_model_len request fits (simkv refuses smaller ones at start-up, as vLLM does)
    fits = group_blocks_per_request(config, max_model_len, startup=True) + 1
    opts["num_gpu_blocks"] = fits + int(rng.integers(0, 40))
    groups = config.kv_cache_groups
    opts["block_size"] = config.cache.block_size  # (FlashInfer's prefill checkpoints align it to 64)
    case = {"opts": opts, "requests": requests, "group_windows": list(groups.windows),
            "group_linear": [g.linear for g in groups.groups]}
    if align:
        case |= {"mamba_cache_mode": "align", "mamba_prefill_checkpoints": config.mamba_prefill_checkpoints}
    if replies:  # (chat sessions whose next turns repeat the replies; after the other draws)
        case["requests"] = oracle_vllm.reply_sessions(rng, max_model_len)
        case["replies"] = True
        oracle_vllm.after_previous_turns(case, oracle_spec.run_simkv)
    return case


def main() -> None:
    a = oracle_vllm.oracle_args(__doc__.split("\n\n")[0], speculative_flag=True, align_flag=True, replies_flag=True,
                                aborts_flag=True, parallel_flag=True, ngram_misses_flag=True, images_flag=True)
    if oracle_vllm.serve_vllm_side(a, oracle_spec.run_vllm):
        return
    import numpy as np
    rng = np.random.default_rng(a.seed)
    cases = [make_case(rng, a.speculative, a.align, a.replies, a.suffix, a.ngram_misses) for _ in range(a.cases)]
    oracle_vllm.parallel_cases(a, rng, cases)
    if a.images and a.replies:
        sys.exit("--images with --replies: not drawn (the images redraw every prompt)")
    oracle_spec.image_cases(a, cases)  # (--images: oracle_spec.py's content; its own generator)
    if a.aborts:  # (a front end aborts some requests: clients that gave up)
        for case in cases:
            case["aborts"] = oracle_vllm.random_aborts(rng, case["requests"])
    theirs = oracle_vllm.vllm_results(str(Path(__file__).parent / "oracle_spec.py"), cases, a)
    oracle_spec.compare_cases(cases, theirs, lambda case: f" linear groups {case['group_linear']}")


if __name__ == "__main__":
    main()
