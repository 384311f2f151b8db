"""KV offloading on models with linear-attention layers (core/kv_offload_mamba.py): recorded cases
of scripts/oracle_offload.py --linear against vLLM 0.33's OffloadingConnector over Mamba groups
in mode "align", and the rules they depend on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simkv.config import ConfigError, EngineConfig
from tests.core.helpers import assert_mutations_break, offload_as_recorded

LINEAR = json.loads((Path(__file__).parent / "data" / "offload_linear_vllm_cases.json").read_text())


@pytest.mark.parametrize("recorded", LINEAR["cases"], ids=LINEAR["ids"])
def test_linear_attention_offloading_matches_vllm(recorded):
    """Tiny Gated DeltaNet, Mamba2 and Nemotron-H configs with Mamba prefix caching: synchronous,
    async scheduling, chunks of 1 to 4 blocks with decode chunks stored, pipeline stages with a
    front end's aborts, chat replies, the ARC policy with a store threshold, MTP drafts (decode
    chunks stored; pipeline stages under async scheduling), decode states stored under retention
    none or periodic (sync, async, the priority policy preempting). Every step, request
    and transfer (loads, the attention chunks' stores and each state's own store) equal vLLM's."""
    assert offload_as_recorded(recorded) is not None


def test_linear_cases_depend_on_each_rule(monkeypatch):
    """Each rule breaks recorded cases when undone: the states the GPU prefix cache keeps are
    stored (vLLM's boundary-state hand-offs), before the step's attention chunks; with MTP drafts a
    decoding request keeps its last complete chunk until it finishes; a steady decoder storing
    decode states caches them at the step that completes their chunk, offered in running order
    before the step's admissions (under async scheduling, a state within a decoder's processed
    tokens first: vLLM cached it when the output was processed); a checkpoint state that no later request can resume at loses
    its cache entry (even at an eagle-drop replay boundary, as vLLM's _cache_partial_tail_block
    does); under pipeline stages a request that finished its prompt no longer counts as an
    in-flight prefill, and an aborted request's tokens in unprocessed batches are not processed
    ones."""
    from simkv.core.kv_offload_hybrid import HybridKVOffload
    from simkv.core.kv_offload_mamba import MambaKVOffload
    from simkv.core.mamba_align import MambaAlignCoordinator
    from simkv.core.scheduler import Scheduler

    def states_last(self, scheduled, num_blocks_of):
        HybridKVOffload.build_stores(self, scheduled, num_blocks_of)
        if self.kv.state_offers:
            self._store_states(self.kv.state_offers)
            self.kv.state_offers.clear()

    def prefills_with_decoders(self, skipped):
        kv = self.kv_cache_manager
        prefills = self._prefilling + list(self.kv_holding) + skipped
        return sum(kv.remaining_blocks(r, min(r.num_tokens, self.max_model_len), min(r.num_tokens, self.max_model_len))
                   for r in prefills)

    release = Scheduler._release_outside_windows

    def states_after_admissions(self, decoders, step):
        for request in decoders:
            self.kv_cache_manager.decode_cache(request, self._known_tokens(request, step, step + request.decode_base + 1))
    offer = MambaKVOffload._offer

    def offer_without_drafts(self, request, num_tokens, view, finished):
        eagle, self.eagle = self.eagle, False
        try:
            offer(self, request, num_tokens, view, finished)
        finally:
            self.eagle = eagle

    def release_all(self, request, num_processed):
        release(self, request, request.num_computed_tokens if self.pipeline_parallel_size > 1 else num_processed)

    mutations = [(MambaKVOffload, "_store_states", lambda self, offers: None, 8),
                 (MambaKVOffload, "build_stores", states_last, 3),
                 (MambaKVOffload, "_offer", offer_without_drafts, 2),
                 (Scheduler, "_cache_decode_states", lambda self, decoders, step: None, 3),
                 (Scheduler, "_cache_decode_states", states_after_admissions, 2),
                 (Scheduler, "_processed_states_first", lambda self, offers, step: offers, 1),
                 (MambaAlignCoordinator, "_keeps_checkpoint", lambda self, request, entry: True, 1),
                 (Scheduler, "_inflight_prefill_blocks", prefills_with_decoders, 1),
                 (Scheduler, "_release_outside_windows", release_all, 1)]
    assert_mutations_break(monkeypatch, mutations, LINEAR["cases"],
                           lambda recorded: offload_as_recorded(recorded) is not None)


def _qwen3_next(**overrides) -> EngineConfig:
    return EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 2,
                                   "kv_offloading_size": 64} | overrides)


def test_offloading_on_linear_attention_is_accepted():
    _qwen3_next()
    _qwen3_next(speculative_method="mtp", num_speculative_tokens=2)
    _qwen3_next(kv_offloading_prompt_only=False, prefix_cache_retention_interval=None)
    with pytest.raises(ConfigError, match="prefix_cache_retention_interval \\(1152\\) must be a multiple"):
        _qwen3_next(kv_offloading_block_size=1728, prefix_cache_retention_interval=1152)  # (a window of a chunk)


def test_capacity_names_the_tier_s_tokens_as_the_attention_group_s():
    """`simkv capacity` on a linear-attention model: the tier's tokens are the attention group's
    chunks; each Mamba group's states take chunks of their own."""
    from click.testing import CliRunner

    from simkv.cli.main import main

    res = CliRunner().invoke(main, ["capacity", "--model", "qwen3-next-80b-a3b", "--gpu", "H200", "-tp", "2",
                                    "--kv-offloading-size", "64", "--json"])
    assert res.exit_code == 0, res.output
    tier = json.loads(res.output)["kv_offloading"]
    assert tier["states_per_group"] and "chunks_per_group" not in tier
    assert tier["chunk_tokens"] == 576 and tier["tokens"] == tier["num_chunks"] * 576
