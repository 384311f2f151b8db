"""Parallel sampling (trace column `n`): sequences share the prompt's blocks by reference count;
the first write into a shared partial block copies it (copy-on-write)."""

import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.config import EngineConfig
from simkv.core.request import RequestStatus
from simkv.core.scheduler import Scheduler
from simkv.replay.api import replay
from simkv.traces.schema import trace_from_frame
from tests.core.helpers import drive, make_config
from simkv.core.request import Request


def _request(i, prompt, output, n):
    return Request(f"r{i}", i, 0.0, prompt, output, num_samples=n)


def _step(s):
    out = s.schedule()
    s.update_from_output(out)
    return out


def test_fork_shares_prompt_blocks_then_copies_on_write():
    s = Scheduler(make_config(num_gpu_blocks=41, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128), 41)
    r = _request(0, 40, 5, 4)  # 40 tokens: 2 full blocks + a partial one
    s.add_request(r)
    _step(s)
    pool = s.kv_cache_manager.block_pool
    assert len(s.running) == 4 and pool.get_num_used_blocks() == 3  # one prompt, shared by 4 sequences
    assert all(b.ref_cnt == 4 for b in s.kv_cache_manager.req_to_blocks[r.index])
    out = _step(s)  # each sequence writes token 40 into the shared partial block
    assert s.kv_cache_manager.num_cow_copies == 3  # the last writer owns the original
    assert pool.get_num_used_blocks() == 3 + 3 and out.num_decode_reqs == 4
    tables = [s.kv_cache_manager.req_to_blocks[q.index] for q in s.running]
    assert len({t[2].block_id for t in tables}) == 4 and len({t[0].block_id for t in tables}) == 1
    while s.has_unfinished_requests():
        out = _step(s)
    assert out.finished == [r] and r.group_output_tokens == 20
    assert pool.get_num_used_blocks() == 0
    pool.check_invariants()


def test_block_aligned_prompt_needs_no_copy():
    s = Scheduler(make_config(num_gpu_blocks=41, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128), 41)
    s.add_request(_request(0, 32, 3, 3))
    drive(s)
    assert s.kv_cache_manager.num_cow_copies == 0


def _check_no_shared_writes(sched):
    """No sequence that has decoded since its fork writes into a block others hold."""
    kv = sched.kv_cache_manager
    kv.block_pool.check_invariants()
    for r in sched.running:
        c = sched.num_computed_tokens(r)
        if r.num_output_tokens >= 2 and c % kv.block_size:
            assert kv.req_to_blocks[r.index][c // kv.block_size].ref_cnt == 1


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(1, 4)), min_size=1, max_size=8),
       st.integers(9, 40), st.sampled_from([4, 8, 16]))
def test_cow_property_and_decode_runs(reqs, blocks, bs):
    results = []
    for runs in (False, True):
        config = make_config(num_gpu_blocks=blocks + 64 // bs + 1, block_size=bs, max_num_seqs=8,
                             max_num_batched_tokens=128, max_model_len=64)
        s = Scheduler(config, blocks + 64 // bs + 1)
        requests = [_request(i, min(p, 63), o, n) for i, (p, o, n) in enumerate(reqs)]
        for q in requests:
            s.add_request(q)
        out = drive(s, use_runs=runs, check=_check_no_shared_writes)
        assert all(q.status == RequestStatus.FINISHED and q.group_remaining == 0 for q in requests)
        assert s.kv_cache_manager.block_pool.get_num_used_blocks() == 0
        results.append((out["steps"], out["preemptions"], out["decode_tokens"], s.kv_cache_manager.num_cow_copies,
                        [q.group_output_tokens for q in requests]))
    assert results[0] == results[1]


def test_replay_reports_copies_and_total_outputs():
    frame = pd.DataFrame({"arrival_time_s": [0.0, 0.5], "prompt_tokens": [100, 70], "output_tokens": [20, 10],
                          "n": [4, 1]})
    res = replay(trace_from_frame(frame), EngineConfig.from_flat(dict(num_gpu_blocks=400, max_model_len=512)), "unit")
    assert res.summary["num_cow_copies"] == 3  # 100 % 16 != 0: three of four sequences copy
    assert res.requests["output_tokens"].tolist() == [80, 10]
    assert res.summary["num_finished"] == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(1, 4)), min_size=1, max_size=8),
       st.integers(9, 40), st.sampled_from([4, 8, 16]))
def test_cow_property_under_async_scheduling(reqs, blocks, bs):
    """Async scheduling forks a request when the step that ends its prompt is scheduled; every
    sequence still finishes with its tokens and nothing leaks."""
    from tests.core.helpers import drive_async

    config = make_config(num_gpu_blocks=blocks + 64 // bs + 1, block_size=bs, max_num_seqs=8,
                         max_num_batched_tokens=128, max_model_len=64, async_scheduling=True)
    s = Scheduler(config, blocks + 64 // bs + 1)
    requests = [_request(i, min(p, 63), o, n) for i, (p, o, n) in enumerate(reqs)]
    for q in requests:
        s.add_request(q)
    drive_async(s, check=_check_no_shared_writes)
    assert all(q.status == RequestStatus.FINISHED and q.group_remaining == 0 for q in requests)
    assert s.kv_cache_manager.block_pool.get_num_used_blocks() == 0
    for q in requests:
        expected = min(q.max_tokens, 64 - q.num_prompt_tokens)
        assert q.group_output_tokens == expected * q.num_samples
