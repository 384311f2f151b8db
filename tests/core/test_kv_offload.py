"""KV offloading to CPU memory (core/kv_offload.py): the tier's LRU, and recorded cases of
scripts/oracle_offload.py against vLLM 0.33's OffloadingConnector."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simkv.core.kv_offload import CPUOffloadManager, StoreAdmission, _Access
from tests.core.helpers import assert_mutations_break, assert_offload_as_recorded, offload_as_recorded


def _store(manager: CPUOffloadManager, access: _Access, keys: list[int], first_position: int = 1):
    stored = manager.prepare_store([(first_position + i, k) for i, k in enumerate(keys)], access)
    if stored:
        manager.complete_store(stored)
    return stored


def test_a_request_s_tail_is_evicted_before_its_head():
    manager = CPUOffloadManager(3)
    a = _Access()
    assert _store(manager, a, [10, 11, 12]) == [10, 11, 12]
    assert _store(manager, _Access(), [20]) == [20]
    assert set(manager.chunks) == {10, 11, 20}  # (12, the last block of the first request, went)


def test_a_finished_request_becomes_the_most_recent_head_last():
    manager = CPUOffloadManager(4)
    a, b = _Access(), _Access()
    _store(manager, a, [10, 11])
    _store(manager, b, [20, 21])
    manager.request_finished(a)  # a's chunks now rank above b's (still running)
    _store(manager, _Access(), [30, 31, 32])
    assert set(manager.chunks) == {10, 30, 31, 32}  # b's tail, b's head, then a's tail went


def test_chunks_in_transfer_are_not_evicted_and_a_store_without_room_fails():
    manager = CPUOffloadManager(2)
    a = _Access()
    pending = manager.prepare_store([(1, 10), (2, 11)], a)  # stores in flight
    assert pending == [10, 11] and manager.lookup(10) == 2
    assert manager.prepare_store([(1, 20)], _Access()) is None
    manager.complete_store([10, 11])
    assert manager.lookup(10) == 1
    manager.prepare_load([(1, 10)], _Access())  # a load pins 10
    assert manager.prepare_store([(1, 20)], _Access()) == [20]
    assert set(manager.chunks) == {10, 20}
    manager.complete_load([10])
    assert manager.prepare_store([(1, 30)], _Access()) == [30]


def test_keys_the_tier_holds_are_not_stored_again():
    manager = CPUOffloadManager(4)
    _store(manager, _Access(), [10, 11])
    assert manager.prepare_store([(1, 10), (2, 11), (3, 12)], _Access()) == [12]


def test_store_threshold_stores_a_chunk_at_its_nth_offer():
    """vLLM's store_threshold: offers count over all requests; a key the tier holds already is
    not held back (a reuse), and held-back keys count as skipped."""
    admission = StoreAdmission(3)
    manager = CPUOffloadManager(8, admission)
    assert manager.prepare_store([(1, 10), (2, 11)], _Access()) == []
    assert manager.prepare_store([(1, 10)], _Access()) == []
    assert _store(manager, _Access(), [10, 11]) == [10]  # (10: 3 offers, 11: 2)
    assert _store(manager, _Access(), [10, 11, 12]) == [11]
    assert admission.num_skipped == 2 + 1 + 1 + 1
    assert admission.counts == {10: 4, 11: 3, 12: 1}


def test_store_threshold_tracker_evicts_its_least_recent_key_but_not_one_this_offer_counts():
    admission = StoreAdmission(2, max_tracker_size=2)
    admission.count([(1, 10), (2, 11)])
    admission.count([(1, 11), (2, 12)])  # 10 is the least recent: it goes, 11 counted again stays
    assert admission.counts == {11: 2, 12: 1}
    admission.count([(1, 11), (2, 12), (3, 13)])  # both counted again: 13 finds no room
    assert admission.counts == {11: 3, 12: 2}
    assert admission.admit([(1, 11), (2, 13)]) == [(1, 11)] and admission.num_skipped == 1


def test_store_threshold_under_arc_learns_only_from_admitted_misses():
    from simkv.core.kv_offload_arc import ARCOffloadManager

    manager = ARCOffloadManager(1, StoreAdmission(2, max_tracker_size=1))
    _store(manager, _Access(), [10])
    _store(manager, _Access(), [10])  # stored at its second offer
    _store(manager, _Access(), [20])  # (the tracker forgets 10)
    assert _store(manager, _Access(), [20]) == [20] and list(manager.b1) == [10]
    manager.prepare_store([(1, 10)], _Access())  # a B1 key held back (counted once again): T1's target stays
    assert manager.target_t1 == 0
    manager.prepare_store([(1, 10)], _Access())  # admitted: a B1 hit
    assert manager.target_t1 == 1


RECORDED = json.loads((Path(__file__).parent / "data" / "offload_vllm_cases.json").read_text())


@pytest.mark.parametrize("case", RECORDED["cases"], ids=RECORDED["ids"])
def test_recorded_cases_match_vllm(case):
    """Random cases of scripts/oracle_offload.py, chosen to cover the tier's evictions, stores
    that found no room (offered again at later steps, at the finish from freed blocks),
    lookups retried while a chunk is being stored or the request's own store is in flight,
    loads after preemptions, and the in-flight prefill reservation that counts a load's
    remaining blocks; five under async scheduling (a request whose last token is in flight
    offers no store). Then the connector's other settings (`--chunks`): chunks of 1 to 4
    blocks, decode blocks stored too (offload_prompt_only off), five of them async (a decoder's
    block is offered once its last token is known, a step later); then speculative decoding
    (`--speculative`: ngram and EAGLE drafts, whose last chunk is never loaded and, while a
    request decodes, not stored), five of those async; then ARC; then the store threshold
(`--store-threshold`: 2 or 3, trackers of 1 to 29 keys in some), under LRU and ARC, with
chunks, sync and async (each of six mutations of the tracker and the filter fails all six);
then chat sessions whose hash lists describe the replies (`--replies`), decode blocks stored
and loaded back by next turns, three sync and two async; then parallel sampling fanned out
(`--parallel`: members that load their group's prompt from the tier), with drafts and with ARC.
Every step, every request's
    first-token and finish step, and every transfer equal vLLM's."""
    assert_offload_as_recorded(case)


ABORTS = json.loads((Path(__file__).parent / "data" / "offload_abort_vllm_cases.json").read_text())


def _as_recorded(recorded) -> bool:
    ours = offload_as_recorded(recorded)
    return ours is not None and ours["aborted"] > 0


@pytest.mark.parametrize("recorded", ABORTS["cases"], ids=ABORTS["ids"])
def test_aborts_match_vllm(recorded):
    """Recorded cases of scripts/oracle_offload.py --aborts: a front end aborts a third of the
    requests (clients that gave up), before a step or before its output, with the CPU tier on.
    An aborted request offers the tier what it computed and vLLM knows (stored at the next
    schedule, as a finish's leftovers), one aborted while its prompt loads keeps its blocks until
    the load ends, and under async scheduling an aborted request that an unprocessed step ran
    has its blocks freed when that step's output is processed. Every step, request and transfer
    equal vLLM's."""
    assert _as_recorded(recorded)


def test_recorded_aborts_depend_on_each_rule(monkeypatch):
    """Four mutations, each must break recorded cases: a loading request's blocks freed at its
    abort, an abort's leftovers stored as a finish's, aborts that offer the tier nothing, and
    no deferred frees under async scheduling."""
    from simkv.core.kv_offload import KVOffload
    from simkv.core.request import RequestStatus
    from simkv.core.scheduler import Scheduler

    abort, finished = Scheduler.abort_request, KVOffload.request_finished

    def immediate(self, request, chunk_end=None):
        loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not request.kv_loaded
        taken = abort(self, request, chunk_end)
        if loading:
            for entry in self._aborted_loads.pop(request):
                self.kv_cache_manager.free_deferred(entry)
        return taken

    def offers_nothing(self, request, chunk_end=None):
        monkeypatch.setattr(self.offload, "request_finished", lambda *args: None)
        try:
            return abort(self, request, chunk_end)
        finally:
            monkeypatch.delattr(self.offload, "request_finished")

    mutations = [(Scheduler, "abort_request", immediate, 3),
                 (KVOffload, "request_finished", lambda self, r, n, t=None: finished(self, r, n), 2),
                 (Scheduler, "abort_request", offers_nothing, 5),
                 (Scheduler, "_ran_unprocessed", lambda self, request: False, 5)]
    assert_mutations_break(monkeypatch, mutations, ABORTS["cases"], _as_recorded)


def test_arc_keeps_a_reused_chunk_over_a_newer_one_stored_once():
    """vLLM's "arc": a chunk another request loaded moves to T2 when that request finishes;
    evictions take T1 (chunks stored and never reused) first while T1 is at its target (0)."""
    from simkv.core.kv_offload_arc import ARCOffloadManager

    manager = ARCOffloadManager(3)
    a, b = _Access(), _Access()
    _store(manager, a, [10, 11])
    manager.prepare_load([(1, 10)], b)
    manager.complete_load([10])
    manager.request_finished(b)  # (b reused 10)
    manager.request_finished(a)
    assert list(manager.t1) == [11] and list(manager.t2) == [10]
    _store(manager, _Access(), [20])
    _store(manager, _Access(), [30])  # full: T1's least recent goes
    assert set(manager.chunks) == {10, 20, 30} and list(manager.b1) == [11]


def test_arc_grows_t1_when_a_key_it_evicted_from_t1_comes_back():
    from simkv.core.kv_offload_arc import ARCOffloadManager

    manager = ARCOffloadManager(2)
    _store(manager, _Access(), [10, 11])
    _store(manager, _Access(), [20])  # evicts 10 into B1
    assert list(manager.b1) == [10] and manager.target_t1 == 0
    again = _Access()
    assert _store(manager, again, [10]) == [10]  # a B1 hit: T1's target grows by max(1, |B2| / |B1|)
    assert manager.target_t1 == 1 and 10 not in manager.b1
    manager.prepare_store([(1, 10)], again)  # (once per request and key)
    assert manager.target_t1 == 1


PIPELINE = json.loads((Path(__file__).parent / "data" / "offload_pp_vllm_cases.json").read_text())


@pytest.mark.parametrize("recorded", PIPELINE["cases"], ids=PIPELINE["ids"])
def test_pipeline_stages_match_vllm(recorded):
    """Recorded cases of scripts/oracle_offload.py --pp: 2 to 4 pipeline stages, vLLM's batch
    queue that many batches deep (one more under async scheduling), with the CPU tier; then with
    a front end's aborts and with replies the next turns repeat. Every step, request and
    transfer equal vLLM's."""
    assert offload_as_recorded(recorded) is not None


def test_pipeline_cases_depend_on_each_rule(monkeypatch):
    """Three rules each break recorded pipeline cases: with a connector vLLM defers a request's
    block frees whenever batches overlap (pipeline stages too, not only async scheduling), a
    request ran by any unprocessed batch counts as in flight (not only the latest), and a reply
    the trace describes is findable once written (a next turn admitted while its previous turn's
    last batch is in flight hits it), not only at the finish."""
    from simkv.core.async_scheduling import AsyncScheduling
    from simkv.core.kv_cache_manager import KVCacheManager
    from simkv.core.remote_kv import RemoteKV

    init = RemoteKV._init_remote_kv

    def latest_only(self, request):
        step = self._scheduled_through
        return step > self._processed_through and self._ran_in(request, step)

    def at_release(self, request, num_tokens):
        if self.enable_caching and request.num_shared_tokens:
            end = min(num_tokens, request.num_tokens) // self.block_size
            self._cache_full_blocks(request, min(end, self.hasher.num_shared_blocks(request)))

    mutations = [(RemoteKV, "_init_remote_kv", lambda self, defer, backoff=0: init(self, defer and self.async_scheduling,
                                                                                   backoff), 4),
                 (AsyncScheduling, "_ran_in_flight", latest_only, 4),
                 (KVCacheManager, "cache_shared_blocks", at_release, 2)]
    assert_mutations_break(monkeypatch, mutations, PIPELINE["cases"],
                           lambda recorded: offload_as_recorded(recorded) is not None)


DRAFT = json.loads((Path(__file__).parent / "data" / "offload_draft_vllm_cases.json").read_text())


@pytest.mark.parametrize("recorded", DRAFT["cases"], ids=DRAFT["ids"])
def test_draft_model_offloading_matches_vllm(recorded):
    """A draft model's layers in the KV-cache group (scripts/oracle_offload.py --speculative
    --draft-model): synchronous, chunks with decode stores, async with aborts, pipeline stages,
    P/D beside the tier, ARC with a store threshold and chat replies. Every step, request and
    transfer equal vLLM's."""
    assert offload_as_recorded(recorded) is not None


def test_a_draft_model_has_no_volatile_last_chunk(monkeypatch):
    """Unlike an EAGLE layer's, a draft model's KV at a position depends on the tokens up to it:
    vLLM stores and loads its last chunk. Treated as EAGLE's, recorded cases break."""
    from simkv.core.kv_offload import KVOffload

    init = KVOffload.__init__

    def as_eagle(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.eagle = True

    assert_mutations_break(monkeypatch, [(KVOffload, "__init__", as_eagle, 4)], DRAFT["cases"], offload_as_recorded)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_reset_tier_empties_it_only_when_nothing_is_in_flight(policy):
    """A new pod's tier (simkv/replay/autoscale.py): KVOffload.reset_tier keeps the kind and
    size of the tier and its store admission's threshold, and forgets what it held."""
    from simkv.core.kv_offload import KVOffload

    offload = KVOffload(8, 16, hasher=None, policy=policy, store_threshold=2)
    manager = offload.manager
    manager.chunks[5] = 1 if policy == "lru" else None
    if policy == "arc":
        manager.t1[5] = [1]
    offload.admission.counts[7] = 1
    offload._jobs[1] = object()  # (a transfer in flight)
    assert not offload.reset_tier() and offload.manager is manager
    del offload._jobs[1]
    assert offload.reset_tier()
    assert type(offload.manager) is type(manager) and offload.manager.num_chunks == 8
    assert offload.manager.lookup(5) == 0 and not offload.admission.counts
    assert offload.admission.threshold == 2 and offload.manager.admission is offload.admission
