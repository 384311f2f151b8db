"""KV offloading beside P/D disaggregation: recorded cases of scripts/oracle_offload.py --pd against
vLLM 0.33's MultiConnector, NIXL first (oracle_pd.py's FakePDConnector, pull mode) and the
OffloadingConnector second, plain requests, sends and pulls mixed in one engine, and the rules
they depend on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.core.helpers import assert_mutations_break, offload_as_recorded

PD = json.loads((Path(__file__).parent / "data" / "offload_pd_vllm_cases.json").read_text())


@pytest.mark.parametrize("recorded", PD["cases"], ids=PD["ids"])
def test_offloading_beside_pd_matches_vllm(recorded):
    """Synchronous and async scheduling, EAGLE and ngram drafts, a front end's aborts, chunks of
    several blocks, ARC with a store threshold, linear-attention and sliding-window models,
    pipeline stages, pipeline stages with NIXL alone (`--pd --no-tier`: no tier), and multi-module
    MTP (a send's prompt truncated by K - 1 tokens, its whole prompt still keyed): every step,
    every request's first-token and finish step, and every CPU-tier load and store equal vLLM's."""
    assert offload_as_recorded(recorded) is not None


def test_pd_cases_depend_on_each_rule(monkeypatch):
    """Each rule breaks recorded cases when undone: a pull waits a step when the tier, asked too,
    says "ask again later" (a chunk of its hit being stored or loaded); a request aborted before
    its first step leaves nothing for the tier to store (the connector has no block table of it);
    on a linear-attention model a pull's local hit is the groups' common one, not the attention
    group's alone (MultiConnector allows divergent hits only if every connector does)."""
    from simkv.core.remote_kv import RemoteKV
    from simkv.core.scheduler import Scheduler

    def attention_group_hits(self, request):
        kv = self.kv_cache_manager
        return kv.get_computed_blocks_for_pull(request) if self._mamba_split else kv.get_computed_blocks(request)

    def all_computed(request, unknown):
        return min(request.num_computed_tokens, request.num_tokens - unknown)

    mutations = [(RemoteKV, "_tier_delays_pull", lambda self, request, num_local: False, 12),
                 (Scheduler, "_aborted_storable", staticmethod(all_computed), 3),
                 (RemoteKV, "_pull_hits", attention_group_hits, 2)]
    assert_mutations_break(monkeypatch, mutations, PD["cases"], offload_as_recorded)

