"""Property tests on random small traces and configs: invariants hold after every step,
nothing leaks, every request finishes, and jumping over decode runs changes nothing."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.core.request import RequestStatus
from simkv.core.scheduler import LivelockError, Scheduler
from tests.core.helpers import drive, make_config, make_request


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(16, 160))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max(max_num_seqs, 1), 256))
    if not chunked:
        budget = max(budget, max_model_len)
    min_blocks = -(-max_model_len // block_size) + 1
    num_gpu_blocks = draw(st.integers(min_blocks + 1, min_blocks + 40))
    options = dict(
        num_gpu_blocks=num_gpu_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, max_model_len=max_model_len, enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()), watermark=draw(st.sampled_from([0.0, 0.01, 0.1])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 8, 15])) if chunked else 0,
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        num_lookahead_tokens=draw(st.sampled_from([0, 0, 3])),
    )
    if draw(st.integers(0, 2)) == 0:  # the policy knobs of other engines' step models
        options.update(
            max_num_admissions_per_step=draw(st.sampled_from([None, 1, 2])),
            admission_order=draw(st.sampled_from(["after_running", "before_running"])),
            preemption_victim=draw(st.sampled_from(["newest", "requester"])),
            preemption_mode=draw(st.sampled_from(["recompute", "restart"])),
            reserve_null_block=draw(st.booleans()),
            scheduler_reserve_full_isl=draw(st.booleans()),
            allocator=draw(st.sampled_from(["paged", "paged", "contiguous"])),
        )
        if options["allocator"] == "contiguous":
            options["num_gpu_blocks"] = max(options["num_gpu_blocks"], 2 * min_blocks)
    prefixes = [[draw(st.integers(0, 5)) for _ in range(6)] for _ in range(3)]
    n = draw(st.integers(1, 25))
    reqs = []
    for i in range(n):
        prompt = draw(st.integers(1, max_model_len - 1))
        output = draw(st.integers(1, 60))
        hashes, h, salt = None, 0, None
        if draw(st.booleans()):
            h = draw(st.sampled_from([4, 8, 12]))
            k = -(-prompt // h)
            hashes = (prefixes[draw(st.integers(0, 2))] * 40)[:k]
            salt = draw(st.sampled_from([None, None, "a", "b"]))
        reqs.append(make_request(i, prompt, output, hashes, h, salt, priority=draw(st.integers(0, 2))))
    waves = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    return options, reqs, waves


def _fresh(reqs):
    return [make_request(r.index, r.num_prompt_tokens, r.max_tokens, r.shared_hash_ids, r.hash_block_tokens,
                         r.cache_salt, r.priority) for r in reqs]


def _run(options, reqs, waves, use_runs, check=None, setup=None):
    """Requests join in waves between steps (arrivals), then the engine drains."""
    sched = Scheduler(make_config(**options), options["num_gpu_blocks"])
    if setup:
        setup(sched)
    pending = list(reqs)
    log = []
    for wave in waves:
        for _ in range(wave):
            if pending:
                sched.add_request(pending.pop(0))
        for _ in range(wave):
            if not sched.has_unfinished_requests():
                break
            out = sched.schedule()
            sched.update_from_output(out)
            log.append((out.step, out.num_prefill_tokens, out.num_decode_reqs, out.num_running, out.num_waiting,
                        out.num_blocks_used, len(out.preempted), out.prefix_hit_tokens))
            if check:
                check(sched)
    for r in pending:
        sched.add_request(r)
    result = drive(sched, use_runs, check)
    return sched, log, result


def _check(sched):
    pool = sched.kv_cache_manager.block_pool
    pool.check_invariants()
    assert 0 <= pool.get_num_used_blocks() <= pool.num_usable_blocks


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_invariants_and_no_leaks(scenario):
    options, reqs, waves = scenario
    try:
        sched, _, _ = _run(options, reqs, waves, use_runs=False, check=_check)
    except LivelockError:
        # Dropping outputs on preemption, or preempting the requester, can livelock (requests
        # preempting themselves or each other forever); it must be reported, never hang.
        # vLLM's policy (the newest request, recompute) always makes progress.
        assert options.get("preemption_mode") == "restart" or options.get("preemption_victim") == "requester"
        return
    pool = sched.kv_cache_manager.block_pool
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    assert pool.get_num_used_blocks() == 0, "blocks leaked"
    assert not sched.kv_cache_manager.req_to_blocks
    for r in reqs:
        assert r.num_output_tokens == min(r.max_tokens, options["max_model_len"] - r.num_prompt_tokens)
        assert r.num_computed_tokens == r.num_tokens - 1
    if options.get("allocator") == "contiguous":
        assert pool.num_free_slots == pool.num_slots and len(pool.starts) == 1  # fully coalesced


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_decode_runs_change_nothing(scenario):
    options, reqs, waves = scenario
    if options.get("preemption_mode") == "restart" or options.get("preemption_victim") == "requester":
        options = dict(options, preemption_mode="recompute", preemption_victim="newest")  # may livelock
    a_sched, a_log, a = _run(options, _fresh(reqs), waves, use_runs=False)
    b_sched, b_log, b = _run(options, _fresh(reqs), waves, use_runs=True, check=_check)
    assert a_log == b_log
    for key in ("steps", "preemptions", "preempted_requests", "hits", "queries", "prefill_tokens", "decode_tokens"):
        assert a[key] == b[key], key
    assert [x[:3] for x in a["log"]] == [x[:3] for x in b["log"]]
    pool_a = a_sched.kv_cache_manager.block_pool
    pool_b = b_sched.kv_cache_manager.block_pool
    if options.get("allocator", "paged") == "paged":
        assert pool_a.free_block_queue.block_ids() == pool_b.free_block_queue.block_ids()
    assert pool_a.num_evictions == pool_b.num_evictions


def _snapshots(into):
    """A step check that also records the free queue, the evictions and every block table."""
    def check(sched):
        _check(sched)
        kv = sched.kv_cache_manager
        into.append((kv.block_pool.free_block_queue.block_ids(), kv.block_pool.num_evictions,
                     sorted((i, [b.block_id for b in t]) for i, t in kv.req_to_blocks.items())))
    return check


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans())
def test_private_block_chunks_change_nothing(scenario, use_runs):
    """Releasing a request's private blocks as one free-queue chunk (and starting with the
    never-used blocks as one chunk) gives, after every step, the same free queue (block ids in
    order), the same block tables and the same evictions as one node per block."""
    options, reqs, waves = scenario
    if options.get("preemption_mode") == "restart" or options.get("preemption_victim") == "requester":
        options = dict(options, preemption_mode="recompute", preemption_victim="newest")  # may livelock
    if options.get("allocator") == "contiguous":
        return  # no blocks to chunk

    def one_by_one(sched):
        sched.kv_cache_manager.release_private_as_chunk = False
        sched.kv_cache_manager.block_pool.free_block_queue.expand_chunks()  # the never-used blocks too

    chunked, single = [], []
    _, a_log, a = _run(options, _fresh(reqs), waves, use_runs, check=_snapshots(chunked))
    _, b_log, b = _run(options, _fresh(reqs), waves, use_runs, check=_snapshots(single), setup=one_by_one)
    assert a_log == b_log and a == b
    assert chunked == single


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans())
def test_block_calendar_equals_boundary_heap(scenario, use_runs):
    """The block calendar (periodic boundaries, per residue of the step) and the boundary heap
    (one event per decoder) give, after every step, the same free queue, the same block
    tables and the same evictions. (After a decode run cut short by a dry pool, the heap has
    already given step `end` its first blocks, which the calendar leaves to that step: so with
    runs, the states are compared at the end.)"""
    options, reqs, waves = scenario
    if options.get("preemption_mode") == "restart" or options.get("preemption_victim") == "requester":
        options = dict(options, preemption_mode="recompute", preemption_victim="newest")  # may livelock
    # where the calendar serves: a paged pool without lookahead slots
    options = dict(options, allocator="paged", num_lookahead_tokens=0)

    calendar, heap = [], []
    a_sched, a_log, a = _run(options, _fresh(reqs), waves, use_runs, check=_snapshots(calendar))
    b_sched, b_log, b = _run(options, _fresh(reqs), waves, use_runs, check=_snapshots(heap),
                             setup=lambda sched: sched._calendar is not None and sched._calendar_to_heap(0))
    assert a_sched._calendar is not None and b_sched._calendar is None
    assert a_log == b_log and a == b
    assert calendar == heap if not use_runs else calendar[-1:] == heap[-1:]


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_salts_never_share_blocks(scenario):
    options, reqs, waves = scenario
    options = dict(options, enable_prefix_caching=True, allocator="paged", preemption_mode="recompute")
    owners: dict[int, set] = {}

    def check(sched):
        kv = sched.kv_cache_manager
        by_index = {r.index: r for r in sched.running}
        for index, blocks in kv.req_to_blocks.items():
            r = by_index.get(index)
            if r is None:
                continue
            for b in blocks:
                owners.setdefault(b.block_id, set())
                if b.ref_cnt > 1:
                    salts = {x.cache_salt for x in sched.running
                             if any(bb is b for bb in kv.req_to_blocks.get(x.index, ()))}
                    assert len(salts) == 1, f"block {b.block_id} shared across salts {salts}"

    try:
        _run(options, reqs, waves, use_runs=False, check=check)
    except LivelockError:  # checked at every step until then; as in test_invariants_and_no_leaks,
        assert options.get("preemption_victim") == "requester"  # only this policy may livelock here
