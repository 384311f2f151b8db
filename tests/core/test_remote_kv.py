"""P/D disaggregation in the engine core (core/remote_kv.py): pulled admissions, the KV-holding
queue, blocks held for sending. The three recorded cases are real vLLM 0.33 (its Scheduler with
a KV connector that behaves as NIXL's pull mode; scripts/oracle_pd.py, which compared 560 random
cases step for step, all equal), and so are the three with speculative decoding, the sliding-window
ones, those under async scheduling and those of linear-attention models."""

import copy
import json
from pathlib import Path

import pytest

from simkv.core.request import KV_PULL, KV_SEND, RequestStatus
from simkv.core.scheduler import Scheduler
from tests.core.helpers import assert_mutations_break, drive_pd, drive_pd_async, make_config, make_request

CASES = json.loads((Path(__file__).parent / "data" / "pd_vllm_cases.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=["inflight-reservation", "priority", "small-pool-sends"])
def test_recorded_cases_match_vllm(case):
    ours = drive_pd(case)
    assert ours["steps"] == case["vllm_steps"]
    assert ours["requests"] == case["vllm_requests"]


def _assert_same_as_recorded(case: dict) -> None:
    """A recorded case of scripts/oracle_pd.py ({"case", "vllm"}): simkv's steps and requests are vLLM's."""
    ours = drive_pd(case["case"])
    theirs = case["vllm"]["steps"]
    while theirs and not any(theirs[-1]):
        theirs.pop()
    assert ours["steps"] == theirs
    assert ours["requests"] == case["vllm"]["requests"]


SPEC_CASES = json.loads((Path(__file__).parent / "data" / "pd_spec_vllm_cases.json").read_text())["cases"]


@pytest.mark.parametrize("case", SPEC_CASES, ids=["draft-model-pull-held-in-flight", "draft-model-admitted-prefill",
                                                  "eagle-block-drop"])
def test_recorded_speculative_cases_match_vllm(case):
    """With speculative decoding (scripts/oracle_pd.py --speculative): a pull also leaves free the
    blocks of one speculative step, in-flight prefills (pulls, and requests admitted earlier in
    the step) reserve their first speculative step too, a pulled request stays one until its
    step ends, and EAGLE under a KV connector drops a hit's last block instead of lookahead keys."""
    _assert_same_as_recorded(case)


HYBRID = json.loads((Path(__file__).parent / "data" / "pd_hybrid_vllm_cases.json").read_text())


@pytest.mark.parametrize("case", HYBRID["cases"], ids=HYBRID["ids"])
def test_recorded_sliding_window_cases_match_vllm(case):
    """Sliding-window models under P/D (scripts/oracle_pd.py --hybrid): a pull's window groups
    take blocks only inside their window of the pulled prompt, a finished request gives back its
    out-of-window blocks before the connector holds the rest, the pulled blocks are cached when
    the pull ends (after the local hits), and a pull leaves one speculative step free in every
    group. With EAGLE under the connector, the full-attention groups (the draft layer's) look one
    block past the hit and drop it, and the window groups retain the runs before vLLM's two
    replay boundaries a block lower."""
    _assert_same_as_recorded(case)


CHUNKED = json.loads((Path(__file__).parent / "data" / "pd_chunked_vllm_cases.json").read_text())


@pytest.mark.parametrize("case", CHUNKED["cases"], ids=CHUNKED["ids"])
def test_recorded_chunked_local_attention_cases_match_vllm(case):
    """Chunked local attention (Llama 4) under P/D (scripts/oracle_pd.py --chunked): a pull's local
    groups take blocks only from the start of the pulled prompt's last attention chunk, and a
    finished send gives back what left its chunk before the connector holds the rest."""
    _assert_same_as_recorded(case)


ASYNC = json.loads((Path(__file__).parent / "data" / "pd_async_vllm_cases.json").read_text())


def _trimmed(rows: list) -> list:
    rows = list(rows)
    while rows and not any(rows[-1]):  # (vLLM's engine steps once more to report the last finish)
        rows.pop()
    return rows


@pytest.mark.parametrize("case", ASYNC, ids=[c["name"] for c in ASYNC])
def test_recorded_async_scheduling_cases_match_vllm(case):
    """P/D under async scheduling (scripts/oracle_pd.py --async-scheduling: vLLM's AsyncScheduler
    with a kv_both connector, driven as its batch queue drives it, empty batches included). A
    preemption whose victim ran in the step in flight does not happen (the requester and the
    requests after it wait a step), a request that finishes while a step in flight runs it
    frees its blocks when that output is processed, a victim's blocks are cached whole (no
    token of it is in flight), a schedule() that runs nothing is no step (nobody slips), window
    releases go by the tokens whose output was processed (none is in flight after such a
    schedule), and at a finish under the hybrid manager too. Reverting any of these fails at
    least one case; the first five run without sliding windows, the last three with them."""
    ours = drive_pd_async(case["case"])
    sched = ours.pop("scheduler")
    assert _trimmed(ours["steps"]) == _trimmed(case["vllm"]["steps"])
    assert ours["requests"] == case["vllm"]["requests"]
    assert (sched.spec_stats["num_accepted_tokens"] if sched.num_spec_tokens else 0) == case["vllm"]["accepted"]


LINEAR = json.loads((Path(__file__).parent / "data" / "pd_linear_vllm_cases.json").read_text())


@pytest.mark.parametrize("case", LINEAR["cases"], ids=LINEAR["ids"])
def test_recorded_linear_attention_cases_match_vllm(case):
    """Linear-attention models under P/D (scripts/oracle_pd.py --linear). The first four without
    prefix caching: the prefill engine drops a send's last prompt token and a pull loads the
    prompt less that token (vLLM's NIXL prefill backoff for Mamba layers: the decode side
    computes it from the state before it); a pull reserves for the in-flight prefills the block
    that last token may need; and, with MTP, a linear group's blocks being max_model_len tokens
    long, a full sequence plus a speculative step past max_model_len asks one more block of each
    in that reservation. The next four with prefix caching (--align): a pull's local hit is the
    attention group's, the Mamba groups' own hit counted but not taken, their reservations
    counted; a pull whose hits covered it once stays a pull until scheduled; a padded
    one-token chunk the Mamba split cuts keeps one token. The last four with MTP and prefix
    caching: the attention group's eagle block drop, the states' checkpoints, retained
    boundaries and chunk ends a block lower, a checkpoint keyed by the block below its table
    index, a truncated send keeping its whole prompt's block keys, and (async) the deferred
    frees. Dropping any of these fails at least one case."""
    case = copy.deepcopy(case)
    case["case"]["opts"]["model"] = str(Path(__file__).resolve().parents[2] / case["case"]["opts"]["model"])
    if not case["case"]["opts"].get("async_scheduling"):
        _assert_same_as_recorded(case)
        return
    ours = drive_pd_async(case["case"])
    sched = ours.pop("scheduler")
    assert _trimmed(ours["steps"]) == _trimmed(case["vllm"]["steps"])
    assert ours["requests"] == case["vllm"]["requests"]
    assert sched.spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]


def _sched(**kw):
    blocks = kw.pop("num_gpu_blocks", 32)
    return Scheduler(make_config(num_gpu_blocks=blocks, block_size=4, max_num_seqs=kw.pop("max_num_seqs", 8),
                                 max_num_batched_tokens=kw.pop("max_num_batched_tokens", 64), max_model_len=64,
                                 **kw), blocks)


def _step(sched):
    out = sched.schedule()
    sched.update_from_output(out)
    return out


def test_pull_waits_aside_and_computes_its_last_prompt_token():
    sched = _sched()
    pulled, plain = make_request(0, 10, 3), make_request(1, 6, 2)
    pulled.kv_role = KV_PULL
    sched.add_request(pulled)
    sched.add_request(plain)
    out = _step(sched)
    # the pull gets blocks for its whole prompt and no tokens; the plain request behind it runs
    assert out.kv_loads == [pulled] and pulled.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [c.request for c in out.chunks] == [plain]
    assert sched.kv_cache_manager.num_blocks_of(pulled) == 3 and pulled.kv_pull_blocks == 3
    assert out.num_waiting == 1 and out.num_running == 1
    out = _step(sched)  # still loading: skipped again
    assert out.kv_loads is None and out.num_prefill_tokens == 0 and out.num_decode_reqs == 1
    sched.finished_recving(pulled)
    out = _step(sched)
    chunk = out.chunks[0]
    assert (chunk.request, chunk.num_computed_tokens, chunk.num_new_tokens) == (pulled, 9, 1)
    assert pulled.num_output_tokens == 1 and pulled.first_token_step == out.step
    while sched.has_unfinished_requests():
        _step(sched)
    assert pulled.num_output_tokens == 3 and sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0


def test_sent_blocks_stay_until_read():
    sched = _sched()
    sent = make_request(0, 8, 1)
    sent.kv_role = KV_SEND
    sched.add_request(sent)
    out = _step(sched)
    assert out.finished == [sent] and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 2 == sched.num_blocks_held_for_sending
    sched.finished_sending(sent)
    assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0 and not sched.kv_held


def test_pulled_blocks_are_cached_when_the_data_has_arrived():
    """A prefix-sharing pull admitted while another one's data is on its way finds no hit; after
    the data arrived it does, and pulls only the rest."""
    sched = _sched()
    first, second, third = (make_request(i, 12, 2, hashes=[7, 8, 9], h=4) for i in range(3))
    for r in (first, second):
        r.kv_role = KV_PULL
        sched.add_request(r)
    out = _step(sched)
    assert out.kv_loads == [first, second] and second.kv_pull_blocks == 3 and out.prefix_hit_tokens == 0
    sched.finished_recving(first)
    _step(sched)  # first promoted: its blocks are cached now
    third.kv_role = KV_PULL
    sched.add_request(third)
    out = _step(sched)
    assert out.kv_loads == [third] and third.num_prefix_hit_tokens == 8 and third.kv_pull_blocks == 1


def test_a_pull_leaves_running_prefills_the_blocks_they_still_need():
    """vLLM's in-flight prefill reservation: a pull is admitted only if the blocks a chunked
    prefill still needs for its whole prompt stay free, though the pull alone would fit."""
    sched = _sched(num_gpu_blocks=20, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    long_prompt = make_request(0, 60, 2)  # 15 blocks in all
    sched.add_request(long_prompt)
    _step(sched)  # alone, so no threshold: 16 tokens, 4 blocks
    pulled = make_request(1, 20, 2)  # 5 blocks
    pulled.kv_role = KV_PULL
    sched.add_request(pulled)
    pool = sched.kv_cache_manager.block_pool
    while long_prompt.num_computed_tokens < 60:
        out = _step(sched)
        assert out.kv_loads is None and pulled.status == RequestStatus.WAITING
        held = sched.kv_cache_manager.num_blocks_of(long_prompt)
        if long_prompt.num_computed_tokens <= 40:  # 5 blocks free, but not with the prefill's rest kept aside
            assert pool.get_num_free_blocks() >= 5 and pool.get_num_free_blocks() - (15 - held) < 5
    while pulled.status == RequestStatus.WAITING:
        out = _step(sched)
    assert out.kv_loads == [pulled] and long_prompt.status == RequestStatus.FINISHED


ABORTS = json.loads((Path(__file__).parent / "data" / "pd_abort_vllm_cases.json").read_text())


def _aborts_as_recorded(recorded: dict) -> bool:
    """simkv's steps, requests (and under async scheduling its accepted drafts) are vLLM's."""
    case, theirs = recorded["case"], recorded["vllm"]
    async_scheduling = case["opts"].get("async_scheduling")
    ours = (drive_pd_async if async_scheduling else drive_pd)(case)

    def trim(steps):
        steps = list(steps)
        while steps and not any(steps[-1]):
            steps.pop()
        return steps

    sched = ours["scheduler"]
    accepted = sched.spec_stats["num_accepted_tokens"] if async_scheduling and sched.num_spec_tokens else 0
    return (trim(ours["steps"]) == trim(theirs["steps"]) and ours["requests"] == theirs["requests"]
            and accepted == theirs.get("accepted", 0) and ours.get("error") == theirs.get("error")
            and ours["aborted"] > 0)


@pytest.mark.parametrize("recorded", ABORTS["cases"], ids=ABORTS["ids"])
def test_recorded_abort_cases_match_vllm(recorded):
    """Recorded cases of scripts/oracle_pd.py --aborts: a front end aborts a third of the
    requests, sends, pulls and plain ones, before a step or before its output. An aborted send
    frees its blocks at once (NIXL keeps only a finished one's); a pull aborted while its KV
    arrives keeps its blocks until the transfer reports; under async scheduling the frees of a
    request an unprocessed step ran wait for that step's output, and with sliding windows the
    blocks that left the window go first, by the processed tokens. Every step and request as
    vLLM 0.33's."""
    assert _aborts_as_recorded(recorded)


def test_recorded_abort_cases_depend_on_each_rule(monkeypatch):
    """Five mutations, each must break recorded cases: an aborted pull's blocks freed at once,
    no deferred frees, no window release before them, a release by the computed tokens (none in
    flight), and a decoder's stall before the latest forgotten (it ran in neither of two steps)."""
    from simkv.core.async_scheduling import AsyncScheduling

    abort_waiting = Scheduler._abort_waiting

    def immediate(self, request, num_blocks):
        loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not request.kv_loaded
        abort_waiting(self, request, num_blocks)
        if loading:
            for entry in self._aborted_loads.pop(request):
                self.kv_cache_manager.free_deferred(entry)

    def ran_in_latest_stall_only(request, step):
        if request.last_sched_step == step:
            return True
        if request.decode_base is not None:
            return request.decode_from_step <= step and request.stall_step != step
        return request.is_finishing and request.decode_last_step == step

    mutations = [(Scheduler, "_abort_waiting", immediate, 4),
                 (AsyncScheduling, "_ran_unprocessed", lambda self, request: False, 6),
                 (Scheduler, "_release_outside_windows", lambda self, request, num_processed: None, 3),
                 (AsyncScheduling, "_unprocessed_work", lambda self, request: (0, 0), 1),
                 (AsyncScheduling, "_ran_in", staticmethod(ran_in_latest_stall_only), 1)]
    assert_mutations_break(monkeypatch, mutations, ABORTS["cases"], _aborts_as_recorded)
