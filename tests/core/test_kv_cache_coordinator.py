"""Sliding-window models: KV-cache groups and the coordinator (vLLM's hybrid KV-cache manager)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.config import EngineConfig
from simkv.core.kv_cache_coordinator import KVCacheCoordinator
from simkv.core.kv_cache_groups import group_layers
from simkv.core.request import RequestStatus
from simkv.core.scheduler import Scheduler
from simkv.specs import get_model_spec
from tests.core.helpers import (assert_same_async_replay_as_vllm, assert_same_async_spec_steps_as_vllm,
                                assert_same_steps_as_vllm, drive, drive_async, make_request)

DATA = Path(__file__).parent / "data" / "hybrid_vllm_cases.json"
SPEC_DATA = Path(__file__).parent / "data" / "hybrid_spec_vllm_cases.json"
ASYNC_DATA = Path(__file__).parent / "data" / "hybrid_async_vllm_cases.json"
EAGLE_DATA = Path(__file__).parent / "data" / "hybrid_eagle_vllm_cases.json"
EAGLE_ASYNC_DATA = Path(__file__).parent / "data" / "hybrid_eagle_async_vllm_cases.json"


@pytest.mark.parametrize("index", range(10))
def test_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_hybrid.py: vLLM 0.33's scheduler with the same KV-cache
    groups (one to seven; full attention and windows of 2 to 40 tokens; retention intervals 0,
    none and periodic; caching off in one): every step's scheduled tokens, running, waiting and
    blocks in use, every request's first-token and finish step, prefix-cache queries and hits."""
    case = json.loads(DATA.read_text())["cases"][index]
    ours = assert_same_steps_as_vllm(case)
    stats = ours["scheduler"].kv_cache_manager.prefix_cache_stats
    assert [stats.queries, stats.hits] == case["vllm"]["prefix"]


@pytest.mark.parametrize("index", range(9))
def test_same_steps_as_vllm_async(index, tmp_path):
    """Recorded cases of scripts/oracle_hybrid_async.py (those with the most preemptions of 40, and
    one where the admission cap's second batch in flight keeps a request waiting):
    vLLM 0.33's AsyncScheduler with a two-deep batch queue and the same KV-cache groups, 1 s steps.
    Window blocks are freed on the tokens whose output was processed, and the admission cap
    counts two batches in flight. Every step's scheduled tokens, running, waiting and blocks in
    use, every request's first-token and finish time, preemptions and prefix hits are vLLM's."""
    assert_same_async_replay_as_vllm(json.loads(ASYNC_DATA.read_text())[index], tmp_path)


@pytest.mark.parametrize("index", range(4))
def test_same_steps_as_vllm_with_ngram_drafts(index):
    """Recorded cases of scripts/oracle_hybrid.py --speculative: ngram speculative decoding (K of
    1 to 5, acceptance 0.5 to 1) on sliding-window groups; vLLM caches the verified blocks when the
    tokens arrive. Steps, requests, prefix cache and accepted drafts are vLLM's."""
    case = json.loads(SPEC_DATA.read_text())["cases"][index]
    ours = assert_same_steps_as_vllm(case)
    stats = ours["scheduler"].kv_cache_manager.prefix_cache_stats
    assert [stats.queries, stats.hits] == case["vllm"]["prefix"]
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]


@pytest.mark.parametrize("index", range(4))
def test_same_steps_as_vllm_with_an_eagle_layer(index):
    """Recorded cases of scripts/oracle_hybrid.py --speculative with EAGLE (K of 2 or 3): the
    draft layer's KV in the full-attention groups, K lookahead slots in every group, block keys
    that cover the token after each block (vLLM's lookahead block hashes), in every group and under
    retention intervals 0, periodic and none. Steps, requests, prefix cache and accepted drafts
    are vLLM's."""
    case = json.loads(EAGLE_DATA.read_text())["cases"][index]
    assert case["case"]["opts"]["speculative_method"] == "eagle"
    ours = assert_same_steps_as_vllm(case)
    stats = ours["scheduler"].kv_cache_manager.prefix_cache_stats
    assert [stats.queries, stats.hits] == case["vllm"]["prefix"]
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]
    assert ours["scheduler"].kv_cache_manager.hasher.lookahead == 1


@pytest.mark.parametrize("index", range(4))
def test_same_steps_as_vllm_with_an_eagle_layer_async(index):
    """Recorded cases of scripts/oracle_spec_async.py --hybrid: EAGLE under vLLM's AsyncScheduler
    (two batches deep) on sliding-window groups. A window group frees by the tokens whose output
    was processed (computed tokens, placeholders included, less those in flight), and verified
    blocks are cached when a step's output arrives. Every step, every request's first-token and
    finish step, the accepted drafts and the prefix-cache counts are vLLM's."""
    recorded = json.loads(EAGLE_ASYNC_DATA.read_text())["cases"][index]
    assert_same_async_spec_steps_as_vllm(recorded)


# (windows per group, layers per group) as vLLM 0.33's _get_kv_cache_groups_uniform_page_size forms them
# for the same layer patterns (checked in its venv; the last three on 2026-12-01).
GROUPS_BY_VLLM = [
    (get_model_spec("gemma-3-27b").layer_windows(), [(1024, 9)] * 4 + [(1024, 8)] * 2 + [(0, 10)], 10),
    (get_model_spec("gemma-3-12b").layer_windows(), [(1024, 8)] * 5 + [(0, 8)], 8),
    (get_model_spec("gemma-2-9b").layer_windows(), [(4096, 21), (0, 21)], 21),
    ([128 if i % 2 == 0 else 0 for i in range(25)], [(128, 13), (0, 12)], 13),  # 13 < 1.5 * 12: the larger size
    ([0] * 20 + [64] * 30, [(0, 20), (64, 15), (64, 15)], 20),
    ([64, 0, 64, 64] * 6, [(64, 6)] * 3 + [(0, 6)], 6),
    ([32] * 10, [(32, 10)], 10),
    # with an EAGLE draft layer (a full-attention spec with is_draft, which vLLM buckets with the
    # target's full-attention layers: is_draft takes no part in the spec's equality)
    (get_model_spec("gpt-oss-120b").layer_windows() + [0], [(128, 18), (0, 19)], 19),
    (get_model_spec("gemma-3-27b").layer_windows() + [0], [(1024, 11)] * 2 + [(1024, 10)] * 3 + [(0, 11)], 11),
    ([8] * 32 + [0], [(8, 1)] * 32 + [(0, 1)], 1),  # every layer slides: one-layer groups
]


@pytest.mark.parametrize("windows, groups, size", GROUPS_BY_VLLM)
def test_groups_as_vllm_forms_them(windows, groups, size):
    got = group_layers(windows)
    assert [(g.sliding_window, g.num_layers) for g in got.groups] == groups
    assert got.layers_per_block == size
    assert got.num_padding_layers == len(groups) * size - len(windows)


def test_disabling_the_hybrid_manager():
    """vLLM's --disable-hybrid-kv-cache-manager: a mixed model's layers all allocate like full
    attention (one group); a model whose layers all slide keeps its sliding-window group."""
    mixed = group_layers(get_model_spec("gemma-3-27b").layer_windows(), disable_hybrid=True)
    assert [(g.sliding_window, g.num_layers) for g in mixed.groups] == [(0, 62)]
    assert not mixed.has_sliding_window
    uniform = group_layers([32] * 10, disable_hybrid=True)
    assert uniform.windows == (32,) and uniform.has_sliding_window


def _scheduler(blocks=64, window=8, interval=2, block_size=4, **opts) -> Scheduler:
    """tiny-llama's 2 layers: interval 2 gives groups [window, full]; 0 gives [window]."""
    flat = dict(model="tiny-llama", sliding_window=window, full_attention_interval=interval, block_size=block_size,
                num_gpu_blocks=blocks, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8) | opts
    return Scheduler(EngineConfig.from_flat(flat), blocks)


def _run_one(sched: Scheduler, request) -> None:
    sched.add_request(request)
    while sched.has_unfinished_requests():
        sched.update_from_output(sched.schedule())


def test_window_blocks_are_given_back_to_the_front_of_the_queue():
    """Window 5, block 4, caching off, one group: a 12-token prompt takes blocks 1-3. At its
    first decode the tokens 0-7 are out of the next token's window: blocks 2 and 1 go to the
    front of the free queue (descending index order, then prepended), and the 13th token's new
    block is the head: block 2."""
    sched = _scheduler(blocks=16, window=5, interval=0, enable_prefix_caching=False)
    kv = sched.kv_cache_manager
    assert isinstance(kv, KVCacheCoordinator)
    request = make_request(0, 12, 3)
    sched.add_request(request)
    sched.update_from_output(sched.schedule())
    assert kv.get_group_block_ids(request) == [[1, 2, 3]]
    sched.schedule()
    assert kv.get_group_block_ids(request) == [[0, 0, 3, 2]]  # 0: the null block
    assert kv.block_pool.free_block_queue.block_ids()[:3] == [1, 4, 5]


def test_sliding_window_group_holds_about_a_window():
    """A 100-token prompt decoding 150 tokens, window 8, block 4: the full-attention group holds a
    block per 4 tokens, the sliding-window group at most ceil(7 / 4) + 1 = 3 blocks from its first
    decode on (the prefill chunk needed all 25); the pool's invariants hold at every step."""
    sched = _scheduler(blocks=120)
    kv = sched.kv_cache_manager
    request = make_request(0, 100, 150)
    sched.add_request(request)
    peaks = []
    while sched.has_unfinished_requests():
        sched.update_from_output(sched.schedule())
        kv.block_pool.check_invariants()
        if request.status == RequestStatus.RUNNING:
            window, full = kv.get_group_block_ids(request)
            assert len(full) == -(-sched.num_computed_tokens(request) // 4)  # (after the step: its tokens' blocks)
            peaks.append(sum(b != 0 for b in window))
    assert peaks[0] == 25 and max(peaks[1:]) == 3
    assert kv.block_pool.get_num_used_blocks() == 0


@pytest.mark.parametrize("retention, hits", [(0, [0, 36, 0, 24]), (None, [0, 36, 24, 24])])
def test_junctions_and_retention(retention, hits):
    """Four 40-token prompts, one after another (8-token hash blocks, window 8, block 4):
    A [1 2 3 4 5], B = A, C [1 2 3 9 9] and D [1 2 3 7 7] share A's first 24 tokens.
    B resends A: it hits up to the block below 39. Under retention 0 A cached only its
    sliding-window blocks before that boundary, so C, which the full-attention group would
    give 24 tokens, hits nothing; its lookup marks the junction at 24 and C caches its window
    blocks there, so D hits 24. With every block retained (None), C hits 24 at once."""
    sched = _scheduler(blocks=200, prefix_cache_retention_interval=retention)
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [1, 2, 3, 7, 7]]
    got = []
    for i, hashes in enumerate(prompts):
        request = make_request(i, 40, 2, hashes, 8)
        _run_one(sched, request)
        got.append(request.num_prefix_hit_tokens)
    assert got == hits


def test_admission_counts_a_window_group_up_to_its_cap():
    """full_sequence_must_fit: a 200-token request in a pool of 100 blocks (block 4, window 8,
    budget 16). Full attention needs 50 blocks; the window group is capped at
    ceil(min(7 + 16, 256) / 4) + 1 = 7, not 50: 57 fit. With the window group counted whole
    (hybrid manager disabled, both layers full attention) 100 blocks are needed."""
    hybrid = _scheduler(blocks=101, max_num_batched_tokens=16)
    kv = hybrid.kv_cache_manager
    request = make_request(0, 200, 1)
    assert kv.allocate_slots(request, 0, 16, kv.get_computed_blocks(request), full_sequence_must_fit=True) is not None
    assert kv.block_pool.get_num_used_blocks() == 8  # 4 + 4: the first chunk in both groups
    plain = _scheduler(blocks=101, max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=True)
    assert not isinstance(plain.kv_cache_manager, KVCacheCoordinator)
    assert plain.kv_cache_manager.allocate_slots(make_request(0, 200, 1), 0, 16, full_sequence_must_fit=True) is not None
    small = _scheduler(blocks=56, max_num_batched_tokens=16)
    big = make_request(1, 200, 1)
    assert small.kv_cache_manager.allocate_slots(big, 0, 16, full_sequence_must_fit=True) is None


@st.composite
def hybrid_scenarios(draw):
    block_size = draw(st.sampled_from([2, 4, 8]))
    window = draw(st.integers(2, 40))
    max_model_len = 128
    n = draw(st.integers(1, 25))
    prefixes = [[draw(st.integers(0, 3)) for _ in range(16)] for _ in range(2)]
    requests = []
    for i in range(n):
        prompt = draw(st.integers(1, max_model_len - 1))
        share = draw(st.booleans())
        requests.append((i, prompt, draw(st.integers(1, 40)), prefixes[i % 2][:-(-prompt // 8)] if share else None,
                         draw(st.integers(0, 6))))
    opts = dict(model="gemma-2-9b", sliding_window=window, full_attention_interval=draw(st.sampled_from([0, 2, 3])),
                block_size=block_size, max_model_len=max_model_len,
                max_num_batched_tokens=draw(st.sampled_from([32, 64, 256])), max_num_seqs=draw(st.sampled_from([2, 8])),
                enable_prefix_caching=draw(st.booleans()), watermark=draw(st.sampled_from([0.0, 0.05])),
                prefix_cache_retention_interval=draw(st.sampled_from([0, None])), async_scheduling=draw(st.booleans()))
    config = EngineConfig.from_flat(opts | {"num_gpu_blocks": 2})  # (a pool as vLLM's start-up check asks)
    from simkv.capacity import group_blocks_per_request

    fits = group_blocks_per_request(config, max_model_len, startup=True) + 1
    opts["num_gpu_blocks"] = fits + draw(st.integers(0, 80))
    return opts, requests


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_scenarios())
def test_invariants_no_leaks_and_determinism(scenario):
    """Random sliding-window engines, synchronous or async (the batch queue's order): the pool's
    invariants hold after every step, every request finishes, no block leaks, and a second run
    takes the same steps."""
    opts, requests = scenario
    async_ = opts["async_scheduling"]

    def run():
        sched = Scheduler(EngineConfig.from_flat(opts), opts["num_gpu_blocks"])
        made = [make_request(i, prompt, output, hashes, 8 if hashes else 0, arrival=float(arrival))
                for i, prompt, output, hashes, arrival in requests]
        for request in made:
            sched.add_request(request)
        check = lambda s: s.kv_cache_manager.block_pool.check_invariants()  # noqa: E731
        result = drive_async(sched, check=check) if async_ else drive(sched, check=check)
        assert all(r.status == RequestStatus.FINISHED for r in made)
        assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0
        assert all(not g.req_to_blocks for g in getattr(sched.kv_cache_manager, "groups", ()))
        return result

    assert run() == run()
