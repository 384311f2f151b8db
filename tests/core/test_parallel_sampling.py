"""Parallel sampling (trace column `n`). vLLM v1 fans a request for n sequences out into n
requests that share the prompt through the prefix cache (`parallel_sampling: fan_out`, the
default; checked against vLLM's scheduler, scripts/oracle_fuzz.py --parallel, recorded below).
vLLM v0 forked sequences after the prompt that share its blocks by reference count, the first
write into a shared partial block copying it (`fork`)."""

import heapq
import json
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.config import EngineConfig
from simkv.core.request import RequestStatus
from simkv.core.request_queue import PriorityRequestQueue
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


FORK = dict(parallel_sampling="fork")


def test_fork_shares_prompt_blocks_then_copies_on_write():
    s = Scheduler(make_config(num_gpu_blocks=41, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128,
                              **FORK), 41)
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
    s = Scheduler(make_config(num_gpu_blocks=41, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128,
                              **FORK), 41)
    s.add_request(_request(0, 32, 3, 3))
    while s.has_unfinished_requests():
        _step(s)
    assert s.kv_cache_manager.num_cow_copies == 0


def test_fan_out_members_share_the_prompt_through_the_prefix_cache():
    """vLLM v1: four requests, added one after the other. The first is given 40 prompt tokens; its
    two full blocks are findable as soon as it is scheduled, so the next three, admitted in the
    same step, hit 32 tokens each and compute the last 8: 40 + 3 x 8 tokens in the step, 3 + 3
    blocks. Nothing is copied, and the group completes with its last member."""
    s = Scheduler(make_config(num_gpu_blocks=41, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128), 41)
    r = _request(0, 40, 5, 4)
    s.add_request(r)
    out = _step(s)
    assert out.total_num_scheduled_tokens == 40 + 3 * 8 and len(s.running) == 4
    assert s.kv_cache_manager.block_pool.get_num_used_blocks() == 3 + 3
    assert [q.num_prefix_hit_tokens for q in s.running] == [0, 32, 32, 32]
    finished = []
    while s.has_unfinished_requests():
        finished += _step(s).finished
    assert finished == [r] and r.group_output_tokens == 20 and s.kv_cache_manager.num_cow_copies == 0
    assert s.kv_cache_manager.block_pool.get_num_used_blocks() == 0


def test_fan_out_members_of_a_long_prompt_wait_behind_its_chunks():
    """A 100-token prompt in 32-token chunks: the first request takes each step's whole budget,
    so the others are admitted with its last chunk (step 3), hitting its 6 full blocks (96
    tokens) and computing 4 tokens each."""
    s = Scheduler(make_config(num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256), 64)
    s.add_request(_request(0, 100, 3, 3))
    scheduled = [_step(s).total_num_scheduled_tokens for _ in range(4)]
    assert scheduled == [32, 32, 32, 4 + 2 * 4]
    assert [q.num_prefix_hit_tokens for q in s.running] == [0, 96, 96]


def test_fan_out_members_share_unique_prompt_content_but_not_their_outputs():
    """Without hash ids a prompt is unique content: the members still share it (one prompt), and
    blocks filled by their outputs stay their own: a later request with the same unique content
    cannot exist, but a preempted member finds its prompt again."""
    s = Scheduler(make_config(num_gpu_blocks=41, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128), 41)
    r = _request(0, 64, 40, 2)
    s.add_request(r)
    _step(s)
    child = s.running[1]
    hasher = s.kv_cache_manager.hasher
    assert child.num_prefix_hit_tokens == 48  # (3 of 4 full prompt blocks: one token is left to compute)
    assert [hasher.block_key(child, i) for i in range(4)] == [hasher.block_key(r, i) for i in range(4)]
    while r.num_computed_tokens < 64 + 17:
        _step(s)
    assert hasher.block_key(child, 4) != hasher.block_key(r, 4)  # (their first output blocks differ)


def test_replay_reports_copies_and_total_outputs():
    frame = pd.DataFrame({"arrival_time_s": [0.0, 0.5], "prompt_tokens": [100, 70], "output_tokens": [20, 10],
                          "n": [4, 1]})
    res = replay(trace_from_frame(frame), EngineConfig.from_flat(dict(num_gpu_blocks=400, max_model_len=512, **FORK)),
                 "unit")
    assert res.summary["num_cow_copies"] == 3  # 100 % 16 != 0: three of four sequences copy
    assert res.requests["output_tokens"].tolist() == [80, 10]
    assert res.summary["num_finished"] == 2
    fanned = replay(trace_from_frame(frame), EngineConfig.from_flat(dict(num_gpu_blocks=400, max_model_len=512)),
                    "unit")
    assert fanned.summary["num_cow_copies"] == 0 and fanned.requests["output_tokens"].tolist() == [80, 10]
    assert fanned.summary["prefix_cache_hits_tokens"] == 3 * 96  # (each later member: 6 full blocks)
    assert fanned.summary["num_prefill_tokens"] == 100 + 3 * 4 + 70


def _check_no_shared_writes(sched):
    """No sequence that has decoded since its fork writes into a block others hold."""
    kv = sched.kv_cache_manager
    kv.block_pool.check_invariants()
    for r in sched.running:
        c = sched.num_computed_tokens(r)
        if r.num_output_tokens >= 2 and c % kv.block_size:
            assert kv.req_to_blocks[r.index][c // kv.block_size].ref_cnt == 1


@pytest.mark.parametrize("mode", ["fork", "fan_out"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(1, 4)), min_size=1, max_size=8),
       st.integers(9, 40), st.sampled_from([4, 8, 16]))
def test_no_shared_writes_and_decode_runs(mode, reqs, blocks, bs):
    results = []
    for runs in (False, True):
        config = make_config(num_gpu_blocks=blocks + 64 // bs + 1, block_size=bs, max_num_seqs=8,
                             max_num_batched_tokens=128, max_model_len=64, parallel_sampling=mode)
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


@pytest.mark.parametrize("mode", ["fork", "fan_out"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(1, 4)), min_size=1, max_size=8),
       st.integers(9, 40), st.sampled_from([4, 8, 16]))
def test_no_shared_writes_under_async_scheduling(mode, reqs, blocks, bs):
    """Async scheduling forks a request when the step that ends its prompt is scheduled (fan-out
    members are requests of their own); every sequence still finishes with its tokens and nothing
    leaks."""
    from tests.core.helpers import drive_async

    config = make_config(num_gpu_blocks=blocks + 64 // bs + 1, block_size=bs, max_num_seqs=8,
                         max_num_batched_tokens=128, max_model_len=64, async_scheduling=True, parallel_sampling=mode)
    s = Scheduler(config, blocks + 64 // bs + 1)
    requests = [_request(i, min(p, 63), o, n) for i, (p, o, n) in enumerate(reqs)]
    samples = [n for _, _, n in reqs]
    for q in requests:
        s.add_request(q)
    drive_async(s, check=_check_no_shared_writes)
    assert all(q.status == RequestStatus.FINISHED and q.group_remaining == 0 for q in requests)
    assert s.kv_cache_manager.block_pool.get_num_used_blocks() == 0
    for q, n in zip(requests, samples):
        expected = min(q.max_tokens, 64 - q.num_prompt_tokens)
        assert q.group_output_tokens == expected * n


def test_fan_out_is_refused_where_it_is_not_modelled():
    from simkv.replay.disaggregated import DisaggregationSpec

    frame = pd.DataFrame({"arrival_time_s": [0.0, 0.5], "prompt_tokens": [100, 70], "output_tokens": [20, 10],
                          "n": [1, 3]})
    trace = trace_from_frame(frame, "n")
    with pytest.raises(ValueError, match="row 1: n = 3 .*not modelled with P/D"):
        replay(trace, EngineConfig.from_flat({}), disaggregation=DisaggregationSpec(1, 1))
    sessions = trace_from_frame(frame.assign(session_id=["a", "a"]), "sessions")
    dp_clients = EngineConfig.from_flat(dict(model="deepseek-v2-lite", data_parallel_size=2, client_timeout_s=5.0))
    with pytest.raises(ValueError, match="not modelled on data-parallel ranks with clients that give up on paced "
                                         "sessions"):
        replay(sessions, dp_clients)
    assert replay(trace, dp_clients).summary["num_finished"] == 2  # (without sessions: modelled)
    forked = replay(trace, EngineConfig.from_flat(dict(parallel_sampling="fork")),
                    disaggregation=DisaggregationSpec(1, 1))  # (the decode side forks the sequences)
    assert forked.requests["output_tokens"].tolist() == [20, 30]


# Cases recorded by scripts/oracle_fuzz.py --parallel --record (8 synchronous, seed 4; 8 under
# async scheduling, seed 5): vLLM 0.33's scheduler given each row's n requests one after the other.
RECORDED = json.loads((Path(__file__).parent / "data" / "fan_out_vllm_cases.json").read_text())


@pytest.mark.parametrize("index", range(len(RECORDED)))
def test_recorded_vllm_cases(index: int) -> None:
    from tests.core.helpers import assert_as_recorded, observed_as_recorded, replay_recorded

    case = RECORDED[index]
    assert_as_recorded(observed_as_recorded(replay_recorded(case)), case["vllm"])


def _broken(monkeypatch=None, opts=None) -> int:
    from tests.core.helpers import assert_as_recorded, observed_as_recorded, replay_recorded

    broken = 0
    for case in RECORDED:
        try:
            assert_as_recorded(observed_as_recorded(replay_recorded(case, opts=opts)), case["vllm"])
        except AssertionError:
            broken += 1
    return broken


def test_recorded_cases_depend_on_the_fan_out(monkeypatch) -> None:
    """vLLM v0's forks break all 16 cases; members that share only the trace's hash ids, not their
    whole prompt as soon as it is scheduled (unique tails found only after release, unique
    prompts never), break 7; members queued after every request of their arrival time and
    priority, instead of right after their first, break 4 (the priority policy's)."""
    assert _broken(opts={"parallel_sampling": "fork"}) == 16
    original = Scheduler._fan_out

    def sharing_hash_ids_only(self, root):
        original(self, root)
        for member in [root, *(q for q in self.waiting if q.parent is root)]:
            member.num_shared_tokens = min(len(root.shared_hash_ids) * root.hash_block_tokens
                                           if root.shared_hash_ids is not None else 0, root.num_prompt_tokens)
            member.prompt_owner = member.index

    monkeypatch.setattr(Scheduler, "_fan_out", sharing_hash_ids_only)
    assert _broken() == 7
    monkeypatch.undo()

    def behind_their_arrival(self, request):
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.index, request.index, request))

    monkeypatch.setattr(PriorityRequestQueue, "add_request", behind_their_arrival)
    monkeypatch.setattr(PriorityRequestQueue, "prepend_request", behind_their_arrival)
    assert _broken() == 4


# Step-mode cases (scripts/oracle_spec.py, oracle_hybrid.py, oracle_linear.py and oracle_spec_async.py
# with --parallel; each case's made_by says which): the fan-out under speculative decoding, on
# sliding-window and Mamba models, and under async scheduling, n up to 14.
STEP_CASES = json.loads((Path(__file__).parent / "data" / "fan_out_step_vllm_cases.json").read_text())["cases"]


def _step_case_equal(recorded: dict) -> bool:
    from tests.core.helpers import assert_same_async_spec_steps_as_vllm, assert_same_steps_as_vllm

    recorded = json.loads(json.dumps(recorded))  # (the helpers trim the recorded steps)
    opts = recorded["case"]["opts"]
    if str(opts.get("model", "")).endswith(".json"):  # (a model config of tests/core/data)
        opts["model"] = str(Path(__file__).parents[2] / opts["model"])
    try:
        if recorded["async"]:
            assert_same_async_spec_steps_as_vllm(recorded)
        else:
            ours = assert_same_steps_as_vllm(recorded)
            sched = ours["scheduler"]
            assert sched.spec_stats["num_accepted_tokens"] == recorded["vllm"]["accepted"]
            stats = sched.kv_cache_manager.prefix_cache_stats
            assert [stats.queries, stats.hits] == recorded["vllm"]["prefix"]
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("index", range(len(STEP_CASES)))
def test_recorded_step_cases(index: int) -> None:
    """Every step, each row's first token (its first member's) and finish (its last member's),
    the accepted drafts and the prefix-cache counts equal vLLM 0.33's."""
    assert _step_case_equal(STEP_CASES[index])


def test_recorded_step_cases_depend_on_the_ties_and_the_lookahead(monkeypatch) -> None:
    """vLLM's front end gives a request's members one arrival time, so under the priority policy
    it preempts the first of them in running order (preempting the last admitted, as for distinct
    arrivals, breaks 6 of the 10 cases) and queues them by request id as strings ("10_id" before
    "1_id": numeric order breaks 3). Under EAGLE a block's key covers the token after it, which
    after the prompt's last full block is each member's own output (sharing that block breaks 3)."""
    def broken() -> int:
        return sum(not _step_case_equal(case) for case in STEP_CASES)

    def newest_member_first(request):
        return -request.priority, -request.arrival_time, -request.prompt_owner, -request.index, request.seq, request

    monkeypatch.setattr(Scheduler, "_victim_entry", staticmethod(newest_member_first))
    assert broken() == 6
    monkeypatch.undo()

    def numeric_ties(self, request):  # (members in the order they were added: their indexes)
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.prompt_owner, request.index,
                                    request.index, request))

    monkeypatch.setattr(PriorityRequestQueue, "add_request", numeric_ties)
    monkeypatch.setattr(PriorityRequestQueue, "prepend_request", numeric_ties)
    assert broken() == 3
    monkeypatch.undo()

    from simkv.core.block_hashing import BlockHasher

    monkeypatch.setattr(BlockHasher, "num_group_prompt_blocks",
                        lambda self, request: request.num_prompt_tokens // self.block_size)
    assert broken() == 3


def test_the_summary_separates_a_groups_own_hits():
    """summary.json's `parallel_sampling`: the requests for n > 1, the sequences in all, and the
    prompt tokens their later members hit (their own group's prompt), apart from the hits across
    requests (row 2 repeats row 0's prompt: its 64 full-block tokens hit, the first's and each
    member's)."""
    frame = pd.DataFrame({"arrival_time_s": [0.0, 0.5, 30.0], "prompt_tokens": [70, 40, 70],
                          "output_tokens": [5, 5, 5], "n": [3, 1, 2],
                          "block_hashes": [list(range(5)), [9, 8, 7], list(range(5))], "hash_block_tokens": 16})
    res = replay(trace_from_frame(frame), EngineConfig.from_flat(dict(block_size=16)))
    section = res.summary["parallel_sampling"]
    assert section == {"mode": "fan_out", "sampled_requests": 2, "sequences": 6,
                       "later_members_prefix_hit_tokens": 2 * 64 + 64}
    assert res.summary["prefix_cache_hits_tokens"] == 2 * 64 + 64 + 64  # (+ row 2's first member)
    forked = replay(trace_from_frame(frame), EngineConfig.from_flat(dict(block_size=16, parallel_sampling="fork")))
    assert "later_members_prefix_hit_tokens" not in forked.summary["parallel_sampling"]


def test_a_client_that_gives_up_abandons_every_members_tokens():
    """One row, unit steps: its client gives up after 20.5 s; with 3 samples the engine had
    sampled three times the tokens that reached nobody (summary `client.abandoned_output_tokens`)."""
    def abandoned(n):
        frame = pd.DataFrame({"arrival_time_s": [0.0], "prompt_tokens": [10], "output_tokens": [100], "n": [n]})
        res = replay(trace_from_frame(frame), EngineConfig.from_flat(dict(client_timeout_s=20.5)), "unit")
        return res.summary["client"]["abandoned_output_tokens"]

    assert abandoned(1) == 21 and abandoned(3) == 3 * 21
