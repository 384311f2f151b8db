"""KV offloading on models with sliding-window layers (core/kv_offload_hybrid.py): the lookup,
loads and stores of vLLM's OffloadingConnector over the hybrid KV-cache manager's groups."""

import json
from pathlib import Path

import pytest

from simkv.config import ConfigError, EngineConfig
from simkv.core.kv_offload_hybrid import HybridKVOffload
from simkv.core.scheduler import Scheduler

from tests.core.helpers import assert_mutations_break, offload_as_recorded

RECORDED = json.loads((Path(__file__).parent / "data" / "offload_hybrid_vllm_cases.json").read_text())


def _as_recorded(recorded) -> bool:
    return offload_as_recorded(recorded) is not None


@pytest.mark.parametrize("recorded", RECORDED["cases"], ids=RECORDED["ids"])
def test_recorded_cases_match_vllm(recorded):
    """Random cases of scripts/oracle_offload.py --hybrid (windows of 2 to 40 tokens in one to
    seven groups beside full-attention ones, prefix-cache retention 0, none and periodic; chunks
    of one to four blocks, decode blocks stored too; async scheduling, aborts, a store threshold,
    chat replies); then chunked local attention (`--chunked`: chunks of 2 to 40 tokens, stored
    whole, a hit needing ceil(C / chunk) chunks in a row); then EAGLE drafts (`--speculative`:
    the full-attention groups drop the last chunk they find, and hold back their last complete
    chunk while a request decodes). Every step, every request's
    first-token and finish step, and every transfer (its blocks: a window group's only those in
    its window, or still the request's) equal vLLM's."""
    assert _as_recorded(recorded)


class _Block:
    def __init__(self, block_id):
        self.block_id = block_id


def test_recorded_cases_depend_on_each_rule(monkeypatch):
    """Nine mutations, each must break recorded cases: window blocks handed out again still
    stored (no zeroing), window groups loading every chunk past the local hit, window groups
    storing every chunk (no reachability mask), chunked local groups storing only a sliding
    window's tails, a window group's hit looked up as a prefix run, a request whose load ended
    not learnt afresh when scheduled, an abort under the connector that gives back nothing of its
    windows first, an EAGLE group that loads the last chunk it finds, and one that stores its
    last complete chunk while the request decodes."""
    start_load = HybridKVOffload.start_load

    def from_local_hit(self, request, num_local, num_external):
        tables = self.kv.window_tables
        self.kv.window_tables = lambda r: [[_Block(1)] * 10_000 for _ in tables(r)]
        try:
            return start_load(self, request, num_local, num_external)
        finally:
            del self.kv.window_tables

    def prefix_run(self, request, gid, start, end, first_run):
        return HybridKVOffload._prefix_run(self, request, gid, start, end)

    def with_flag_off(method, flag: str):
        """`method` run with the tier's `flag` (eagle, chunked) off."""
        def mutant(self, *args):
            value = getattr(self, flag)
            setattr(self, flag, False)
            try:
                return method(self, *args)
            finally:
                setattr(self, flag, value)
        return mutant

    masked_like_windows = with_flag_off(HybridKVOffload._reachable, "chunked")

    mutations = [(HybridKVOffload, "handed_out", lambda self, blocks: None, 3),
                 (HybridKVOffload, "start_load", from_local_hit, 3),
                 (HybridKVOffload, "_reachable", lambda self, *args: None, 3),
                 (HybridKVOffload, "_reachable", masked_like_windows, 2),
                 (HybridKVOffload, "_window_run", prefix_run, 3),
                 (HybridKVOffload, "rescheduled", lambda self, index, tables: None, 1),
                 (Scheduler, "_release_outside_windows", lambda self, request, num_processed: None, 2),
                 (HybridKVOffload, "lookup", with_flag_off(HybridKVOffload.lookup, "eagle"), 2),
                 (HybridKVOffload, "_offer", with_flag_off(HybridKVOffload._offer, "eagle"), 2)]
    assert_mutations_break(monkeypatch, mutations, RECORDED["cases"], _as_recorded)


class _Coordinator:
    """What HybridKVOffload asks of the KV-cache coordinator."""

    offload_watch = None

    def __init__(self, junction: int = 0):
        self._junction = junction

    def junction(self, request):
        return self._junction


class _Request:
    def __init__(self, num_prompt_tokens: int):
        self.num_prompt_tokens = num_prompt_tokens


def _tier(window: int, block_size: int = 4, retention=0, blocks_per_chunk: int = 1, hasher=None):
    return HybridKVOffload(8, block_size, hasher, (window, 0), retention, _Coordinator(),
                           blocks_per_chunk=blocks_per_chunk)


def test_window_stores_keep_the_tail_before_the_prompts_last_chunk_boundary():
    """Retention 0 (vLLM's default): a window group stores only the ceil((w - 1) / block_size)
    blocks before the chunk boundary below the prompt's last token, and before a junction."""
    tier = _tier(window=9)  # need = 2 blocks of 4 tokens
    mask = tier._reachable(_Request(30), 0, 8, 8, junction=0, finished=False)
    assert [i for i, m in enumerate(mask) if m] == [5, 6]  # (29 -> boundary 28: blocks 5 and 6)
    mask = tier._reachable(_Request(30), 0, 8, 8, junction=16, finished=False)
    assert [i for i, m in enumerate(mask) if m] == [2, 3, 5, 6]
    chunked = _tier(window=9, blocks_per_chunk=2)  # (chunks of 8 tokens: the boundary is 24)
    mask = chunked._reachable(_Request(30), 0, 8, 4, junction=0, finished=False)
    assert [i for i, m in enumerate(mask) if m] == [4, 5]


def test_window_stores_under_retention_intervals():
    """R > 0: also the tail before every multiple of R; None: every chunk."""
    tier = _tier(window=5, retention=16)  # need 1 block, 4 blocks a segment
    mask = tier._reachable(_Request(50), 0, 12, 12, junction=0, finished=False)
    assert [i for i, m in enumerate(mask) if m] == [3, 7, 11]  # (and 49 -> 48: block 11)
    assert _tier(window=5, retention=None)._reachable(_Request(50), 0, 12, 12, 0, False) is None


class _Manager:
    def __init__(self, held: set[int], pending: frozenset = frozenset()):
        self.held, self.pending = held, pending

    def lookup(self, key):
        return 2 if key in self.pending else 1 if key in self.held else 0


def test_window_lookup_takes_the_last_run_of_a_window_of_chunks():
    """A window group needs ceil(w / chunk) chunks in a row before the hit's end; scanned from
    the right, the first run (a hit ending inside a chunk) one chunk wider; without such a run,
    the run held from the local hit. A run with a chunk still being stored is asked again."""
    tier = _tier(window=8)  # 2 chunks of 4 tokens
    request = type("R", (), {"block_hashes": list(range(8))})()  # (chunk c's key: c, times the 2 groups, + 1)
    tier.hasher = type("H", (), {"block_key": staticmethod(lambda request, i: request.block_hashes[i])})()
    def held(*chunks):
        return {2 * c + 1 for c in chunks}

    tier.manager = _Manager(held(0, 1, 2, 4, 5))
    assert tier._window_run(request, 1, 0, 7, 2) == 6  # (chunks 4, 5; chunk 6 missing)
    assert tier._window_run(request, 1, 0, 6, 3) == 3  # (4 and 5 are two, a first run needs three: then 1, 2)
    tier.manager = _Manager(held(0, 3, 5))
    assert tier._window_run(request, 1, 0, 7, 2) == 1  # (no run of two: the run from the local hit)
    tier.manager = _Manager(held(0, 1, 2, 4, 5), pending=frozenset(held(5)))
    assert tier._window_run(request, 1, 0, 7, 2) is None


def test_a_window_block_handed_out_again_is_not_stored():
    """The connector keeps a request's block ids as it learnt them; a window block any request
    is handed in a later step is no longer the request's (vLLM zeroes its id)."""
    tier = _tier(window=8)
    blocks = [_Block(i) for i in (5, 6, 7)]
    tier.learned(0, [blocks, [_Block(9), _Block(10), _Block(11)]])
    known = tier._known[0]
    tier.handed_out([blocks[1]])  # (the same step: learnt in it, still valid)
    assert tier._valid_blocks(known, 0, 0, 3) == [True, True, True]
    tier.step += 1
    tier.handed_out([blocks[1]])
    assert tier._valid_blocks(known, 0, 0, 3) == [True, False, True]


def _config(**options) -> EngineConfig:
    return EngineConfig.from_flat({"model": "gemma-3-12b", "kv_offloading_size": 4.0} | options)


def test_offloading_with_windows_is_refused_with_odd_retention():
    _config()  # (sliding windows and a CPU tier: modelled, with EAGLE, chunked local attention too)
    _config(speculative_method="eagle3", num_speculative_tokens=2)
    EngineConfig.from_flat({"model": "llama-4-scout", "kv_offloading_size": 4.0})
    with pytest.raises(ConfigError, match=r"prefix_cache_retention_interval \(48\) must be a multiple of "
                                          r"tokens_per_chunk \(32\)"):
        _config(prefix_cache_retention_interval=48, kv_offloading_block_size=32)
    with pytest.raises(ConfigError, match=r"prefix_cache_retention_interval \(1152\) must be a multiple of "
                                          r"tokens_per_chunk \(1728\)"):  # (Mamba groups: windows of a chunk)
        EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "kv_offloading_size": 4.0,
                                "kv_offloading_block_size": 1728, "prefix_cache_retention_interval": 1152})
