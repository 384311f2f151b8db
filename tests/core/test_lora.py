"""LoRA adapters (`--enable-lora`, `--max-loras`): vLLM's max_loras admission rule and adapter
names in the block hashes (docs/semantics.md#lora-adapters---enable-lora---max-loras).

The recorded cases come from the real vLLM 0.33 scheduler with a LoRA config
(`scripts/oracle_fuzz.py --lora [--async-scheduling] --record`)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.traces.lora import assign_adapters, content_namespaces, lora_ids
from simkv.traces.schema import read_trace, trace_from_frame
from tests.cli_runs import cli_fails, cli_ok
from tests.core.helpers import (assert_as_recorded, assert_decode_runs_change_no_bytes, observed_as_recorded,
                                replay_recorded)

RECORDED = json.loads((Path(__file__).parent / "data" / "lora_vllm_cases.json").read_text())


def _equal(ours: dict, theirs: dict) -> bool:
    return (ours["num_steps"] == theirs["num_steps"] and ours["prefix_hits"] == theirs["prefix_hits"]
            and ours["steps"] == theirs["steps"])


@pytest.mark.parametrize("index", range(len(RECORDED["cases"])))
def test_recorded_vllm_cases(index: int) -> None:
    case = RECORDED["cases"][index]
    assert_as_recorded(observed_as_recorded(replay_recorded(case)), case["vllm"])


def test_recorded_cases_depend_on_max_loras_and_on_the_adapters_in_the_hashes(monkeypatch) -> None:
    """Two mutations, each must break recorded cases: no max_loras gate, and adapters left out of
    the block hashes (the cases test both rules, not the base model's scheduling only)."""
    ungated = sum(not _equal(observed_as_recorded(replay_recorded(c, opts={"max_loras": 64})), c["vllm"])
                  for c in RECORDED["cases"])
    import simkv.replay.engine as engine

    monkeypatch.setattr(engine, "content_namespaces", lambda trace: trace.cache_salt)
    unsalted = sum(not _equal(observed_as_recorded(replay_recorded(c)), c["vllm"]) for c in RECORDED["cases"])
    assert ungated >= len(RECORDED["cases"]) // 2 and unsalted >= 2, (ungated, unsalted)


def _adapter_trace(n_adapters: int = 6):
    trace = read_trace("traces/azure_conv_slice.parquet")
    from simkv.traces.schema import take_rows

    return assign_adapters(take_rows(trace, np.arange(600)), n_adapters, 1.0, seed=3)


def test_max_loras_holds_requests_back_and_decode_runs_change_nothing(tmp_path) -> None:
    trace = _adapter_trace()
    ttft = {}
    for k in (1, 2, 6):
        config = EngineConfig.from_flat({"enable_lora": True, "max_loras": k})
        res = assert_decode_runs_change_no_bytes(trace, config, tmp_path / str(k))
        ttft[k] = res.summary["ttft_s"]["p50"]
        lora = res.summary["lora"]
        assert {key: lora[key] for key in ("adapters", "max_loras", "deferrals")} == {
            "adapters": 6, "max_loras": k, "deferrals": res.run.scheduler.num_lora_deferrals}
        assert (res.summary["lora"]["deferrals"] > 0) == (k < 6)
    fleet = EngineConfig.from_flat({"enable_lora": True, "max_loras": 1})
    from simkv.replay.api import FleetSpec

    assert_decode_runs_change_no_bytes(trace, fleet, tmp_path / "fleet", fleet=FleetSpec(2, "prefix_aware"))
    assert ttft[1] > ttft[2] > ttft[6]


def test_adapters_separate_prefixes_and_need_enable_lora(tmp_path) -> None:
    frame = pd.DataFrame({"arrival_time_s": [0.0, 5.0, 10.0], "prompt_tokens": [64, 64, 64], "output_tokens": [2, 2, 2],
                          "block_hashes": [[1, 2, 3, 4]] * 3, "hash_block_tokens": 16,
                          "lora_name": ["a", "b", "a"]})
    trace = trace_from_frame(frame)
    assert list(lora_ids(trace)) == [1, 2, 1]
    assert len(set(content_namespaces(trace))) == 2
    res = replay(trace, EngineConfig.from_flat({"enable_lora": True, "max_loras": 2}))
    assert res.requests["prefix_hit_tokens"].tolist() == [0, 0, 48]  # b shares nothing with a; the second a does
    with pytest.raises(ValueError, match="column 'lora_name' names LoRA adapters: give --enable-lora"):
        replay(trace, EngineConfig.from_flat({}))
    with pytest.raises(ConfigError, match="max_loras must be >= 1"):
        EngineConfig.from_flat({"enable_lora": True, "max_loras": 0})
    path = tmp_path / "t.parquet"
    from simkv.traces.schema import write_trace

    write_trace(trace, path)
    assert "give --enable-lora" in cli_fails(["replay", str(path), "--out", str(tmp_path / "o")])
    out = cli_ok(["replay", str(path), "--enable-lora", "--max-loras", "2", "--out", str(tmp_path / "o")])
    assert "LoRA adapters (max_loras)" in out and "LoRA adapters" in (tmp_path / "o" / "report.html").read_text()
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["config"]["enable_lora"] is True and summary["lora"]["adapters"] == 2


def test_transform_assigns_adapters_per_session_reproducibly(tmp_path) -> None:
    out = cli_ok(["trace", "transform", "traces/kvcache_coding_sessions.parquet", "--lora-adapters", "5",
                  "--out", str(tmp_path / "a.parquet")])
    cli_ok(["trace", "transform", "traces/kvcache_coding_sessions.parquet", "--lora-adapters", "5",
            "--out", str(tmp_path / "b.parquet")])
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert "LoRA adapters" in out
    trace = read_trace(tmp_path / "a.parquet")
    per_session = {}
    for session, name in zip(trace.session_id, trace.lora_name):
        per_session.setdefault(session, set()).add(name)
    assert all(len(names) == 1 for names in per_session.values())
    assert "lora adapters  " in cli_ok(["trace", "inspect", str(tmp_path / "a.parquet")])
    assert "--lora-adapters must be >= 1" in cli_fails(["trace", "transform", "traces/req400.parquet",
                                                         "--lora-adapters", "0", "--out", str(tmp_path / "c.parquet")])


def test_lora_slots_take_kv_cache_memory() -> None:
    """vLLM's stacked LoRA buffers: per slot, rank x (input + output) of every linear layer, the
    TP side sharded; llama-3-8b at rank 16: 80 MiB a slot on one GPU."""
    from simkv.capacity import compute_capacity

    def cap(**options):
        return compute_capacity(EngineConfig.from_flat(options))

    base = cap()
    one, sixteen = cap(enable_lora=True), cap(enable_lora=True, max_loras=16, max_lora_rank=16)
    assert one.lora_bytes == 2 * 16 * 32 * (4096 + 4096 + 2 * (4096 + 1024) + 4096 + 4096 + 2 * (4096 + 14336)
                                             + 14336 + 4096) == 80 << 20
    assert sixteen.lora_bytes == 16 * one.lora_bytes
    assert base.num_gpu_blocks - sixteen.num_gpu_blocks == (16 * one.lora_bytes) // base.block_bytes + 1 or \
        base.num_gpu_blocks - sixteen.num_gpu_blocks == (16 * one.lora_bytes) // base.block_bytes
    tp2 = cap(enable_lora=True, tensor_parallel_size=2)
    assert one.lora_bytes / 2 < tp2.lora_bytes < one.lora_bytes  # (only the TP side of each layer is sharded)
    assert cap(enable_lora=True, model="qwen3-30b-a3b").lora_bytes is None  # (experts: not modelled)


LORA_TIER = json.loads((Path(__file__).parent / "data" / "offload_lora_vllm_cases.json").read_text())


@pytest.mark.parametrize("recorded", LORA_TIER["cases"], ids=LORA_TIER["ids"])
def test_adapters_with_a_cpu_tier_and_pd_match_vllm(recorded):
    """Step by step against vLLM 0.33's scheduler with a LoRA config (scripts/oracle_offload.py
    --lora): with a CPU tier (sync, async with aborts, pipeline stages), with P/D's pulls and
    sends beside it or alone (sync, async with drafts). Every step, request and transfer equal."""
    from tests.core.helpers import offload_as_recorded

    assert offload_as_recorded(recorded) is not None


def test_adapter_cases_depend_on_each_rule(monkeypatch):
    """Each rule breaks recorded cases when undone: a request passed over for want of an adapter
    slot after its KV was loaded (from the tier) or pulled keeps its place in the KV-holding
    queue, blocks and all (it went to the waiting queue, and its next lookup took its own blocks
    again); a pulled one-token prompt, whose computed count is 0, goes to the waiting queue
    (vLLM's _holds_kv_blocks); a pull is checked against max_loras before the connector."""
    from simkv.core.remote_kv import RemoteKV
    from simkv.core.scheduler import Scheduler
    from tests.core.helpers import assert_mutations_break, offload_as_recorded

    def always_waiting(self, queue, skipped, skipped_waiting):
        skipped_waiting.append(queue.pop_request())

    def always_holding(self, queue, skipped, skipped_waiting):
        (skipped if queue is self.kv_holding else skipped_waiting).append(queue.pop_request())

    next_waiting = RemoteKV._next_waiting

    def pulls_unchecked(self, skipped, plan, delayed, loras=None):
        return next_waiting(self, skipped, plan, delayed, None)

    mutations = [(Scheduler, "_set_aside", always_waiting, 8),
                 (Scheduler, "_set_aside", always_holding, 2),
                 (RemoteKV, "_next_waiting", pulls_unchecked, 5)]
    assert_mutations_break(monkeypatch, mutations, LORA_TIER["cases"], offload_as_recorded)
