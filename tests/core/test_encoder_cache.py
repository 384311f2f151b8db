"""Multimodal items in the engine core: vLLM's encoder cache and its encoder-input scheduling
(simkv/core/encoder_cache.py, Scheduler._encoder_inputs). The chunk sizes below are worked by
hand from vLLM 0.33's _try_schedule_encoder_inputs; recorded cases of the real scheduler are in
tests/replay/test_multimodal.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from simkv.core.encoder_cache import EncoderCacheManager
from simkv.core.scheduler import Scheduler
from tests.core.helpers import drive, make_config, make_request


def _scheduler(budget: int = 64, **kw) -> Scheduler:
    config = make_config(num_gpu_blocks=200, max_num_batched_tokens=budget, max_model_len=1024, max_num_seqs=8,
                         mm_max_tokens_per_item=kw.pop("mm_max", budget), **kw)
    return Scheduler(config, 200)


def _request(i: int, prompt: int, items, output: int = 2, arrival: float = 0.0):
    request = make_request(i, prompt, output, arrival=arrival)
    request.mm_items = tuple(items)
    return request


def _prefill_chunks(scheduler: Scheduler) -> list[int]:
    return [prefill for _, prefill, _, _ in drive(scheduler, use_runs=False)["log"] if prefill]


def test_a_chunk_stops_before_an_item_the_cache_cannot_take():
    # budget and cache 64 embeddings; item 0 at [10, 74) fills the cache while the chunk [64, 128)
    # still needs it, so item 1 at [80, 144) cannot be allocated: the chunk ends at 80. Once item 0
    # is computed past, it is freeable and evicted for item 1.
    scheduler = _scheduler()
    scheduler.add_request(_request(0, 200, [(10, 64, 7), (80, 64, 8)]))
    assert _prefill_chunks(scheduler) == [64, 16, 64, 56]
    assert (scheduler.num_encoded_items, scheduler.num_encoded_embeds) == (2, 128)
    assert scheduler.encoder_cache.num_evicted_entries == 1
    assert scheduler.num_encoder_stops == 1


def test_text_of_the_same_lengths_is_not_cut():
    scheduler = _scheduler()
    scheduler.add_request(_request(0, 200, []))
    assert _prefill_chunks(scheduler) == [64, 64, 64, 8]


def test_unchunked_items_end_chunks_before_them():
    # disable_chunked_mm_input: [0, 64) would split the item at [30, 80): the chunk stops at 30
    scheduler = _scheduler(disable_chunked_mm_input=True)
    scheduler.add_request(_request(0, 100, [(30, 50, 1)]))
    assert _prefill_chunks(scheduler) == [30, 64, 6]


def test_an_item_larger_than_the_step_budget_gets_its_own_budget():
    # vLLM's budget is max(max_num_batched_tokens, the largest item): an item of 100 embeddings
    # with 64 tokens a step is encoded whole in the step that first reaches it
    scheduler = _scheduler(mm_max=100)
    scheduler.add_request(_request(0, 150, [(0, 100, 1)]))
    assert _prefill_chunks(scheduler) == [64, 64, 22]
    assert scheduler.num_encoded_embeds == 100


@pytest.mark.parametrize("same_image", [True, False])
def test_equal_images_are_encoded_once(same_image):
    scheduler = _scheduler(budget=256)
    scheduler.add_request(_request(0, 120, [(0, 60, 5)]))
    scheduler.add_request(_request(1, 120, [(20, 60, 5 if same_image else 6)]))
    drive(scheduler, use_runs=False)
    assert scheduler.num_encoded_items == (1 if same_image else 2)


def test_a_full_encoder_cache_holds_the_next_request_back():
    # the first request's item fills the cache until its chunk computes past it; the second
    # request's item must wait (its text before the item runs meanwhile)
    scheduler = _scheduler(budget=64)
    scheduler.add_request(_request(0, 200, [(0, 64, 1)]))
    scheduler.add_request(_request(1, 100, [(10, 64, 2)]))
    first = scheduler.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in first.chunks] == [("r0", 64)]
    assert first.encoder_item_embeds == (64,)


def test_preemption_drops_the_references_and_re_encodes_an_evicted_item():
    cache = EncoderCacheManager(10)
    a, b = _request(0, 50, [(0, 6, 1)]), _request(1, 50, [(0, 6, 2)])
    assert cache.can_allocate(6, 10, 0)
    cache.allocate(a, 0)
    assert not cache.can_allocate(6, 10, 0)  # (a's item is referenced: nothing to evict)
    cache.free(a)  # (a preempted)
    assert cache.can_allocate(6, 10, 0)  # (evicts a's entry, the oldest unreferenced)
    cache.allocate(b, 0)
    assert not cache.check_and_update_cache(a, 0)  # (a must encode it again)
    assert cache.num_evicted_entries == 1


def test_eviction_is_oldest_first_and_a_repeated_image_is_one_entry():
    cache = EncoderCacheManager(12)
    a = _request(0, 100, [(0, 4, 1), (10, 4, 1), (20, 4, 2)])  # (image 1 twice)
    for i in (0, 2):
        assert cache.can_allocate(4, 12, 0)
        cache.allocate(a, i)
    assert cache.check_and_update_cache(a, 1)
    cache.free_encoder_input(a, 0)
    assert not cache.freeable  # (image 1 is still referenced through item 1)
    cache.free_computed(a, 100)
    assert list(cache.freeable) == [1, 2]  # (freed in item order)
    assert cache.can_allocate(8, 12, 0)  # (needs 4 more than the 4 free: evicts the oldest, image 1)
    assert list(cache.freeable) == [2] and 1 not in cache.cached


# Recorded cases of scripts/oracle_spec.py / oracle_spec_async.py --images --method eagle: images with
# EAGLE drafts, whose one-token read-ahead vLLM adds to the encoder's window (vLLM 0.33).
SPEC_IMAGES = json.loads((Path(__file__).parent / "data" / "spec_images_vllm_cases.json").read_text())


@pytest.mark.parametrize("mode, index", [(m, i) for m in ("sync", "async") for i in range(len(SPEC_IMAGES[m]))])
def test_images_with_eagle_drafts_step_as_vllm(mode, index):
    from tests.core.helpers import assert_same_async_spec_steps_as_vllm, assert_same_steps_as_vllm

    check = assert_same_steps_as_vllm if mode == "sync" else assert_same_async_spec_steps_as_vllm
    check(copy.deepcopy(SPEC_IMAGES[mode][index]))


def test_an_unshifted_encoder_window_steps_otherwise(monkeypatch):
    """The window of vLLM's encoder scheduling ends at the chunk's end plus the drafter's read-ahead
    (EAGLE: 1): every recorded case steps otherwise without it."""
    from tests.core.helpers import assert_same_async_spec_steps_as_vllm, assert_same_steps_as_vllm

    plain_init = Scheduler.__init__

    def unshifted(self, *args, **kw):
        plain_init(self, *args, **kw)
        self.encoder_window_shift = 0

    monkeypatch.setattr(Scheduler, "__init__", unshifted)
    for mode, check in (("sync", assert_same_steps_as_vllm), ("async", assert_same_async_spec_steps_as_vllm)):
        for case in SPEC_IMAGES[mode]:
            with pytest.raises(AssertionError):
                check(copy.deepcopy(case))


# Recorded cases of scripts/oracle_linear.py and oracle_spec_async.py --images --align: images on
# models with Mamba layers under vLLM's Mamba prefix caching (and MTP drafts), sync and async.
LINEAR_IMAGES = json.loads((Path(__file__).parent / "data" / "linear_images_vllm_cases.json").read_text())


@pytest.mark.parametrize("mode, index", [(m, i) for m in ("sync", "async") for i in range(len(LINEAR_IMAGES[m]))])
def test_images_on_linear_attention_models_step_as_vllm(mode, index):
    from tests.core.helpers import assert_same_async_spec_steps_as_vllm, assert_same_steps_as_vllm

    check = assert_same_steps_as_vllm if mode == "sync" else assert_same_async_spec_steps_as_vllm
    check(copy.deepcopy(LINEAR_IMAGES[mode][index]))
    stripped = copy.deepcopy(LINEAR_IMAGES[mode][index])
    for r in stripped["case"]["requests"]:
        r.pop("mm")
    with pytest.raises(AssertionError):  # (the items are what makes it step as vLLM)
        check(stripped)


def test_stored_items_are_loaded_and_an_encode_instance_stores_what_it_encodes():
    """Encoder disaggregation (vLLM's ec_connector over shared storage): an item in the store is
    loaded (encoder-cache room, none of the step's encoder budget), others are encoded; an
    encode instance (ec_role ec_producer) adds what a step encoded once the step ran."""
    consumer = _scheduler(ec_role="ec_consumer")
    consumer.add_request(_request(0, 100, [(4, 32, 5)]))
    out = consumer.schedule()
    assert out.encoder_loaded_embeds == (32,) and out.encoder_item_embeds == ()
    assert consumer.num_loaded_items == 1 and consumer.num_encoded_items == 0
    producer = _scheduler(ec_role="ec_producer")
    producer.add_request(_request(0, 100, [(4, 32, 5), (40, 16, 6)]))
    out = producer.schedule()
    assert out.encoder_item_embeds == (32, 16) and producer.ec_store == set()
    producer.update_from_output(out)
    assert producer.ec_store == {5, 6}
    other = _scheduler(ec_role="ec_producer")  # (another encode instance on the same store)
    other.ec_store = producer.ec_store
    other.add_request(_request(1, 100, [(4, 32, 5)]))  # (the same image again: found in the store)
    out = other.schedule()
    assert out.encoder_loaded_embeds == (32,) and out.encoder_item_embeds == ()


# Recorded cases of scripts/oracle_spec.py --images --encode-only: encode instances (vLLM's
# mm_encoder_only), whose prompts are consumed in chunks even with chunked prefill off.
ENCODE_ONLY = json.loads((Path(__file__).parent / "data" / "encode_only_vllm_cases.json").read_text())["cases"]


@pytest.mark.parametrize("index", range(len(ENCODE_ONLY)))
def test_encode_instances_step_as_vllm(index):
    from tests.core.helpers import assert_same_steps_as_vllm

    assert_same_steps_as_vllm(copy.deepcopy(ENCODE_ONLY[index]))
    unchunked = copy.deepcopy(ENCODE_ONLY[index])
    unchunked["case"].pop("encode_only")  # (chunked prefill off, as a language model's engine takes it)
    with pytest.raises(AssertionError):
        assert_same_steps_as_vllm(unchunked)


def test_reset_forgets_the_cached_outputs_only_when_none_is_referenced():
    """A new pod's encoder cache (simkv/replay/autoscale.py): empty, its counters kept."""
    scheduler = _scheduler()
    request = _request(0, 200, [(10, 64, 7)])
    scheduler.add_request(request)
    cache = scheduler.encoder_cache
    scheduler.schedule()  # (the first chunk: the item's output is allocated and referenced)
    assert 7 in cache.cached and not cache.reset() and 7 in cache.cached
    drive(scheduler, use_runs=False)
    assert 7 in cache.cached and cache.num_free_slots < cache.cache_size  # (kept, unreferenced)
    encoded = scheduler.num_encoded_items
    assert cache.reset()
    assert not cache.cached and not cache.freeable and cache.num_free_slots == cache.num_freeable_slots == 64
    again = _request(1, 200, [(10, 64, 7)])
    scheduler.add_request(again)
    drive(scheduler, use_runs=False)
    assert scheduler.num_encoded_items == encoded + 1  # (encoded again: nothing was cached)
