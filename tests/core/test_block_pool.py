"""Exact free-queue order on tiny pools, as vLLM's own tests check it."""

from simkv.core.block_pool import BlockPool
from simkv.core.scheduler import Scheduler
from tests.core.helpers import make_config, make_request


def test_initial_queue_and_null_block():
    pool = BlockPool(11, enable_caching=True)
    assert pool.free_block_queue.block_ids() == list(range(1, 11))
    assert pool.get_num_free_blocks() == 10
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    pool.check_invariants()


def test_never_used_blocks_start_as_one_chunk_and_expand_to_the_same_queue():
    from simkv.core.block_pool import BlockChunk

    chunked, single = BlockPool(11, enable_caching=True), BlockPool(11, enable_caching=True)
    assert [type(n) for n in chunked.free_block_queue.nodes()] == [BlockChunk]
    single.free_block_queue.expand_chunks()
    assert len(single.free_block_queue.nodes()) == 10 and all(b.ref_cnt == 0 for b in single.blocks[1:])
    for pool in (chunked, single):
        pool.check_invariants()
    # the same blocks come out in the same order, one at a time or several, and go back alike
    for pool in (chunked, single):
        a = pool.get_new_block()
        b, c = pool.get_new_blocks(2)
        assert [x.block_id for x in (a, b, c)] == [1, 2, 3] and all(x.ref_cnt == 1 for x in (a, b, c))
        pool.cache_block(b, 222)
        pool.free_blocks([c, b, a])
        pool.check_invariants()
    assert chunked.free_block_queue.block_ids() == single.free_block_queue.block_ids() == [3, 1, 4, 5, 6, 7, 8, 9, 10, 2]


def test_free_order_unhashed_front_hashed_back():
    pool = BlockPool(11, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.free_blocks([c, b, a])  # tail first
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    pool.check_invariants()


def test_caching_off_everything_to_front_in_release_order():
    pool = BlockPool(6, enable_caching=False)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, b, a])
    assert pool.free_block_queue.block_ids() == [3, 2, 1, 4, 5]


def test_touch_removes_from_middle_and_lazy_eviction():
    pool = BlockPool(6, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 7)
    pool.cache_block(b, 8)
    pool.free_blocks([b, a])
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 2, 1]
    assert pool.get_cached_block(7) is a  # still cached while free
    pool.touch([a])
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 2]
    assert a.ref_cnt == 1
    got = pool.get_new_blocks(4)  # pops 3, 4, 5, then 2 (evicting hash 8)
    assert [x.block_id for x in got] == [3, 4, 5, 2]
    assert pool.get_cached_block(8) is None and pool.num_evictions == 1
    pool.check_invariants()


def test_reset_prefix_cache_forgets_every_cached_block_only_when_none_is_used():
    pool = BlockPool(11, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.free_blocks([b, a])
    assert not pool.reset_prefix_cache()  # (c is in use: nothing changes)
    assert pool.get_cached_block(111) is a
    pool.free_blocks([c])
    order = pool.free_block_queue.block_ids()
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(111) is None and pool.get_cached_block(222) is None
    assert a.block_hash is None and pool.free_block_queue.block_ids() == order
    pool.get_new_blocks(10)  # (handing the once-cached blocks out evicts nothing now)
    assert pool.num_evictions == 0
    pool.check_invariants()


def test_duplicate_hashes_keep_first_until_evicted():
    pool = BlockPool(5, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 9)
    pool.cache_block(b, 9)
    assert pool.get_cached_block(9) is a
    pool.free_blocks([a])
    pool.get_new_blocks(3)  # 3, 4, then 1 = a (evicted)
    assert pool.get_cached_block(9) is b


def test_request_finish_order_through_the_scheduler():
    """A 40-token request with caching on: 2 full blocks hashed, 1 partial (facts 5)."""
    s = Scheduler(make_config(num_gpu_blocks=11, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), 11)
    s.add_request(make_request(0, 40, 1))
    out = s.schedule()
    s.update_from_output(out)
    assert out.finished and out.finished[0].request_id == "r0"
    assert s.kv_cache_manager.block_pool.free_block_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
