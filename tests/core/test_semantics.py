"""Small probes of vLLM's semantics (the oracle's facts.txt), with exact block counts."""

from simkv.core.scheduler import Scheduler
from tests.core.helpers import make_config, make_request


def small(num_gpu_blocks=101, **kw):
    return Scheduler(make_config(num_gpu_blocks=num_gpu_blocks, max_num_seqs=8, max_num_batched_tokens=512,
                                 max_model_len=512, **kw), num_gpu_blocks)


def step(s):
    out = s.schedule()
    s.update_from_output(out)
    return out


def blocks(s, r):
    return s.kv_cache_manager.num_blocks_of(r)


def test_decode_block_allocation_timing():
    s = small()
    a = make_request(0, 16, 10)
    s.add_request(a)
    step(s)
    assert blocks(s, a) == 1 and s.kv_cache_manager.block_pool.get_num_free_blocks() == 99
    step(s)  # first decode computes token 16: needs block 2
    assert blocks(s, a) == 2
    step(s)
    assert blocks(s, a) == 2


def _hit_for(prompt):
    s = small()
    same = list(range(prompt // 8 + 1))
    x = make_request(0, prompt, 5, same, 8)
    s.add_request(x)
    step(s)
    y = make_request(1, prompt, 5, same, 8)
    s.add_request(y)
    out = step(s)
    return out.prefix_hit_tokens


def test_cache_hit_cap():
    assert [_hit_for(p) for p in (32, 33, 47, 48)] == [16, 32, 32, 32]


def test_identical_prompts_share_within_one_step():
    s = small()
    ids = list(range(8))
    p, q = make_request(0, 64, 5, ids, 8), make_request(1, 64, 5, ids, 8)
    s.add_request(p)
    s.add_request(q)
    out = step(s)
    assert [c.num_new_tokens for c in out.chunks] == [64, 16]
    assert out.prefix_hit_tokens == 48


def test_preemption_victim_is_newest_and_goes_to_front():
    s = small(num_gpu_blocks=9)  # 8 usable blocks
    reqs = [make_request(i, 32, 100) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    out = step(s)
    assert out.num_running == 4 and s.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["r3", "r2"]
    assert [r.request_id for r in s.running] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    assert out.num_decode_reqs == 2 and not out.chunks
    out = step(s)  # no admission: r2 needs 3 blocks, 2 are free
    assert out.num_running == 2 and not out.preempted


def test_no_admission_in_a_step_that_preempted():
    s = small(num_gpu_blocks=9)
    for i in range(4):
        s.add_request(make_request(i, 32, 100))
    step(s)
    s.add_request(make_request(9, 1, 5))  # would fit in the 2 blocks freed by preemption
    out = step(s)
    assert out.preempted and not out.chunks


def test_resumed_request_reuses_its_own_cached_blocks():
    s = small(num_gpu_blocks=7)  # 6 usable; each request peaks at cdiv(40 + 30 - 1, 16) = 5 blocks
    g, h = make_request(0, 40, 30), make_request(1, 40, 30)
    s.add_request(g)
    s.add_request(h)
    for _ in range(10):  # steps 0..9; at step 9 g needs its 4th block (facts 6)
        out = step(s)
    assert [r.request_id for r in out.preempted] == ["r1"]
    for _ in range(40):
        out = step(s)
        if h.status.name == "RUNNING":
            break
    # h was preempted holding 3 full blocks (48 tokens), released tail first to the back of
    # the free queue; g's two later blocks evicted the tail and middle one: 16 tokens remain.
    assert out.prefix_hit_tokens == 16
    assert h.num_preemptions == 1


def test_full_prompt_admission_check():
    # 10 usable blocks; a 200-token prompt needs 13: never admitted while others run
    s = Scheduler(make_config(num_gpu_blocks=21, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256), 21)
    a = make_request(0, 100, 50)  # 7 blocks
    b = make_request(1, 100, 5)   # needs 7 more, only 13 free after a's first chunk of 64 (4 blocks)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert [c.request.request_id for c in out.chunks] == ["r0"]  # budget 64 taken by a
    out = step(s)
    # a: 36 more tokens; b is checked for its whole prompt (7 blocks) against 13 free: admitted
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]


def test_chunked_prefill_off_schedules_whole_prompts():
    s = Scheduler(make_config(num_gpu_blocks=101, max_num_seqs=8, max_num_batched_tokens=512,
                              max_model_len=512, enable_chunked_prefill=False), 101)
    a, b = make_request(0, 300, 5), make_request(1, 300, 5)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert [c.num_new_tokens for c in out.chunks] == [300]


def test_long_prefill_token_threshold_caps_chunks():
    s = Scheduler(make_config(num_gpu_blocks=101, max_num_seqs=8, max_num_batched_tokens=512,
                              max_model_len=512, long_prefill_token_threshold=100), 101)
    a, b = make_request(0, 300, 5), make_request(1, 300, 5)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert [c.num_new_tokens for c in out.chunks] == [100, 100]


def test_salt_separates_tenants():
    s = small()
    ids = list(range(8))
    s.add_request(make_request(0, 64, 5, ids, 8, salt="a"))
    step(s)
    s.add_request(make_request(1, 64, 5, ids, 8, salt="b"))
    assert step(s).prefix_hit_tokens == 0
    s.add_request(make_request(2, 64, 5, ids, 8, salt="a"))
    assert step(s).prefix_hit_tokens == 48


def test_priority_policy_preempts_lowest_priority():
    s = small(num_gpu_blocks=9, scheduling_policy="priority")
    reqs = [make_request(i, 32, 100, priority=p) for i, p in enumerate([5, 0, 1, 0])]
    for r in reqs:
        s.add_request(r)
    step(s)
    out = step(s)
    # victims: max (priority, arrival): r0 (priority 5) first, then r2 (priority 1)
    assert [r.request_id for r in out.preempted] == ["r0", "r2"]


def test_exhausted_budget_leaves_later_decoders_unscheduled():
    """Admissions before the running requests (a policy knob) can use up the token budget:
    the decoders that find no budget left do not advance in that step and catch up later."""
    s = Scheduler(make_config(num_gpu_blocks=101, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64,
                              admission_order="before_running"), 101)
    d1, d2, d3 = make_request(0, 2, 20), make_request(1, 2, 20), make_request(2, 2, 20)
    for r in (d1, d2, d3):
        s.add_request(r)
    step(s)  # all three prefill (6 tokens)
    s.add_request(make_request(3, 8, 3))
    out = step(s)  # the newcomer takes 8 of 10 tokens first: d1, d2 decode, d3 waits a step
    assert out.num_prefill_tokens == 8 and out.num_decode_reqs == 2
    assert [s.num_computed_tokens(r) for r in (d1, d2, d3)] == [3, 3, 2]
    out = step(s)
    assert out.num_decode_reqs == 4
    assert [s.num_computed_tokens(r) for r in (d1, d2, d3)] == [4, 4, 3]
