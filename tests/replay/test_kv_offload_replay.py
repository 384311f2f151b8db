"""KV offloading in a replay: the CPU tier serves a prompt the GPU prefix cache lost; the
transfers take their bytes' time on the host link; unsupported settings are refused."""

import json

import numpy as np
import pandas as pd
import pytest

from simkv.config import CacheConfig, ConfigError, EngineConfig, HardwareConfig, SchedulerConfig
from simkv.replay.api import replay
from simkv.traces.schema import trace_from_frame

SHARED = list(range(1, 17))  # 16 blocks of 16 tokens: a 256-token prompt


def _trace():
    rows = [(0.0, 256, 4, SHARED)]  # A
    rows += [(1.0 + i, 256, 4, [1000 * (i + 1) + j for j in range(16)]) for i in range(6)]  # evict A's blocks
    rows.append((20.0, 256, 4, SHARED))  # B: A's prompt again
    df = pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens", "block_hashes"])
    df["hash_block_tokens"] = 16
    return trace_from_frame(df)


def _config(**cache):
    return EngineConfig(CacheConfig(num_gpu_blocks=40, **cache),
                        SchedulerConfig(max_model_len=512, max_num_batched_tokens=512))


def test_the_cpu_tier_serves_a_prompt_the_gpu_cache_lost():
    plain = replay(_trace(), _config()).summary
    offload = replay(_trace(), _config(kv_offloading_size=1.0)).summary
    assert plain["prefix_cache_hits_tokens"] == 0  # (A's blocks were evicted before B came)
    stats = offload["kv_offloading"]
    assert stats["loads"] == 1 and stats["loaded_tokens"] == 256 and stats["loaded_blocks"] == 16
    assert stats["stored_blocks"] == 7 * 16  # every prompt block, once
    # llama-3-8b: 2 MiB a block on one GPU; 1 GiB holds 512 of them
    assert stats["cpu_chunks"] == 512 and stats["cpu_tier_gib"] == pytest.approx(1.0)
    assert stats["load_bytes"] == 16 * 2 * 1024 * 1024
    assert stats["mean_load_s"] == pytest.approx(16 * 2 * 1024 * 1024 / 63e9, rel=1e-3)
    assert offload["num_prefill_tokens"] == plain["num_prefill_tokens"] - 255  # (B computes its last token)


def test_a_store_larger_than_the_tier_is_not_made():
    """A step's store job is all or nothing (vLLM's prepare_store): 16 blocks do not go into a
    tier of one; the request offers them again while it runs, and the tier stays empty."""
    stats = replay(_trace(), _config(kv_offloading_size=2 / 1024)).summary["kv_offloading"]
    assert stats["cpu_chunks"] == 1 and stats["stored_blocks"] == 0 and stats["loads"] == 0
    assert stats["store_failures"] >= 8  # (each request at least once)


def test_replays_with_offloading_are_deterministic():
    a = replay(_trace(), _config(kv_offloading_size=0.25)).summary
    b = replay(_trace(), _config(kv_offloading_size=0.25)).summary
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


@pytest.mark.parametrize("options, message", [
    (dict(cache=dict(allocator="contiguous")), "allocator 'contiguous'"),
    (dict(cache=dict(enable_prefix_caching=False)), "prefix caching off"),
    (dict(cache=dict(kv_offloading_size=-1.0)), "must be > 0"),
])
def test_unsupported_settings_are_refused(options, message):
    cache = {"kv_offloading_size": 1.0} | options.get("cache", {})
    with pytest.raises(ConfigError, match=message):
        EngineConfig(CacheConfig(**cache), SchedulerConfig(**options.get("scheduler", {})))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_runs_change_nothing_with_offloading(async_scheduling):
    """Requests finishing inside a decode run retire from the tier's recency as when stepping."""
    from tests.core.helpers import assert_decode_runs_change_nothing
    from simkv.traces.schema import read_trace

    trace = read_trace("traces/mooncake_synthetic_slice.parquet")
    config = EngineConfig(CacheConfig(num_gpu_blocks=800, kv_offloading_size=1.0),
                          SchedulerConfig(async_scheduling=async_scheduling))
    result = assert_decode_runs_change_nothing(trace, config)
    stats = result.summary["kv_offloading"]
    assert stats["loads"] > 0 and stats["evicted_blocks"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("cache", [dict(kv_offloading_prompt_only=False),
                                   dict(kv_offloading_block_size=32, kv_offloading_prompt_only=False),
                                   dict(kv_offloading_block_size=64)])
def test_decode_runs_change_nothing_with_decode_stores_and_larger_chunks(cache, async_scheduling):
    """Decode stores come at the steps a decoder completes a chunk: runs stop short of them."""
    from tests.core.helpers import assert_decode_runs_change_nothing
    from simkv.traces.schema import read_trace

    trace = read_trace("traces/mooncake_synthetic_slice.parquet")
    config = EngineConfig(CacheConfig(num_gpu_blocks=800, kv_offloading_size=1.0, **cache),
                          SchedulerConfig(async_scheduling=async_scheduling))
    result = assert_decode_runs_change_nothing(trace, config)
    stats = result.summary["kv_offloading"]
    assert stats["loads"] > 0 and stats["stored_blocks"] > 0


def test_decode_stores_give_a_preempted_request_back_its_output():
    """Two 256 + 400-token requests in 60 blocks: the second is preempted. Its prompt is still
    in the GPU prefix cache; the blocks it had decoded are gone there, and only a tier that
    stores decode blocks (offload_prompt_only off) gives them back instead of computing them."""
    rows = [(0.0, 256, 400, list(range(1, 17))), (0.05, 256, 400, list(range(101, 117)))]
    df = pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens", "block_hashes"])
    df["hash_block_tokens"] = 16
    trace = trace_from_frame(df)

    def run(**cache):
        return replay(trace, EngineConfig(CacheConfig(num_gpu_blocks=60, **cache),
                                          SchedulerConfig(max_model_len=800, max_num_batched_tokens=512))).summary

    plain, prompt_only = run(), run(kv_offloading_size=1.0)
    decode = run(kv_offloading_size=1.0, kv_offloading_prompt_only=False)
    assert plain["num_preemptions"] == prompt_only["num_preemptions"] == decode["num_preemptions"] == 1
    assert prompt_only["kv_offloading"]["loaded_tokens"] == 0  # (the prompt was a local hit)
    assert prompt_only["num_prefill_tokens"] == plain["num_prefill_tokens"]
    stats = decode["kv_offloading"]
    assert stats["stored_blocks"] > prompt_only["kv_offloading"]["stored_blocks"] == 32  # (two prompts)
    assert stats["loaded_tokens"] > 0 and stats["loaded_tokens"] % 16 == 0
    assert decode["num_prefill_tokens"] == plain["num_prefill_tokens"] - stats["loaded_tokens"]


def test_larger_chunks_hold_more_tokens_each_and_fewer_of_them():
    """A 64-token chunk is 4 blocks (8 MiB for llama-3-8b): 1 GiB holds 128. Each 256-token
    prompt is 4 whole chunks: stored as 16 blocks, and B loads A's in one job of 16 blocks."""
    stats = replay(_trace(), _config(kv_offloading_size=1.0, kv_offloading_block_size=64)).summary["kv_offloading"]
    assert stats["cpu_chunks"] == 128 and stats["chunk_tokens"] == 64 and stats["cpu_tier_gib"] == pytest.approx(1.0)
    assert stats["stored_blocks"] == 7 * 16  # (256 tokens: 4 whole chunks each)
    assert stats["loads"] == 1 and stats["loaded_tokens"] == 256 and stats["loaded_blocks"] == 16
    assert stats["load_bytes"] == 16 * 2 * 1024 * 1024


def test_a_store_threshold_of_two_holds_back_chunks_offered_once():
    """vLLM's store_threshold 2: A's prompt and the six others are each offered once (held back:
    7 x 16 chunks), so B finds nothing to load; B's offer of A's prompt is its second: stored."""
    stats = replay(_trace(), _config(kv_offloading_size=1.0, kv_offloading_store_threshold=2)).summary["kv_offloading"]
    assert stats["store_threshold"] == 2 and stats["stores_skipped"] == 7 * 16
    assert stats["loads"] == 0 and stats["stored_blocks"] == 16


@pytest.mark.parametrize("cache, message", [
    (dict(kv_offloading_size=1.0, kv_offloading_block_size=24), r"multiple of block_size 16 \(use 32\)"),
    (dict(kv_offloading_block_size=32), "need kv_offloading_size"),
    (dict(kv_offloading_prompt_only=False), "need kv_offloading_size"),
    (dict(kv_offloading_store_threshold=2), "need kv_offloading_size"),
    (dict(kv_offloading_size=1.0, kv_offloading_store_threshold=-1), "store_threshold must be >= 0"),
    (dict(kv_offloading_size=1.0, kv_offloading_max_tracker_size=0), "max_tracker_size >= 1"),
])
def test_bad_connector_settings_are_refused(cache, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(CacheConfig(**cache), SchedulerConfig())


def _frame(rows):
    df = pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens", "block_hashes"])
    df["hash_block_tokens"] = 16
    return df


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_replica_of_a_fleet_has_its_own_tier(async_scheduling):
    """Two interleaved copies of the eviction trace (the second with other content) on two
    replicas behind round-robin: each replica replays its copy exactly as one engine does, its
    tier's load included (the last request's load ends while its replica is idle: the replica
    wakes itself, its router having nothing more to send)."""
    from simkv.replay.api import FleetSpec

    rows_a = [(0.0, 256, 4, SHARED)] + [(1.0 + i, 256, 4, [1000 * (i + 1) + j for j in range(16)]) for i in range(6)]
    rows_a.append((20.0, 256, 4, SHARED))
    rows_b = [(t + 1e-6, p, o, [h + 100_000 for h in hashes]) for t, p, o, hashes in rows_a]
    interleaved = [row for pair in zip(rows_a, rows_b) for row in pair]
    config = EngineConfig(CacheConfig(num_gpu_blocks=40, kv_offloading_size=1.0),
                          SchedulerConfig(max_model_len=512, max_num_batched_tokens=512,
                                          async_scheduling=async_scheduling))
    fleet = replay(trace_from_frame(_frame(interleaved)), config, fleet=FleetSpec(2, "round_robin")).summary
    singles = [replay(trace_from_frame(_frame(rows)), config).summary for rows in (rows_a, rows_b)]
    stats = fleet["kv_offloading"]
    assert stats["loads"] == 2 and stats["loaded_tokens"] == 512 == sum(s["kv_offloading"]["loaded_tokens"] for s in singles)
    assert stats["cpu_chunks"] == 512 and stats["stored_blocks"] == sum(s["kv_offloading"]["stored_blocks"] for s in singles)
    assert fleet["num_prefill_tokens"] == sum(s["num_prefill_tokens"] for s in singles)
    for row, single in zip(fleet["fleet"]["replicas"], singles):
        assert row["kv_offloading_loaded_tokens"] == 256
        assert row["ttft_s"] == single["ttft_s"] and row["e2e_s"] == single["e2e_s"]


@pytest.mark.parametrize("method, loaded", [("ngram", 256), ("eagle3", 240), ("draft_model", 256)])
def test_an_eagle_drafter_never_loads_its_last_chunk(method, loaded):
    """With an EAGLE-family drafter in the KV-cache group, the drafter's KV at a chunk's last
    position depends on the token after it: B loads A's prompt less its last chunk (and computes
    it); n-gram drafts have no KV of their own, and a draft model's KV at a position depends on
    the tokens up to it: both load it all."""
    from simkv.config import SpeculativeConfig

    draft = {"spec_draft_model": "tiny-llama"} if method == "draft_model" else {}
    config = EngineConfig(CacheConfig(num_gpu_blocks=40, kv_offloading_size=1.0),
                          SchedulerConfig(max_model_len=512, max_num_batched_tokens=512),
                          speculative=SpeculativeConfig(speculative_method=method, num_speculative_tokens=2, **draft))
    stats = replay(_trace(), config).summary["kv_offloading"]
    assert stats["loads"] == 1 and stats["loaded_tokens"] == loaded


def test_a_draft_models_layers_are_in_the_tiers_chunks():
    """A draft model's layers share the target's KV-cache group: a chunk holds both models' KV
    (llama-3-8b's 2 MiB block and tiny-llama's layers), so a tier of the same size holds fewer."""
    from simkv.capacity import compute_capacity
    from simkv.config import SpeculativeConfig

    plain = compute_capacity(EngineConfig(CacheConfig(kv_offloading_size=1.0), SchedulerConfig()))
    draft = compute_capacity(EngineConfig(CacheConfig(kv_offloading_size=1.0), SchedulerConfig(),
                                          speculative=SpeculativeConfig(speculative_method="draft_model",
                                                                        num_speculative_tokens=2,
                                                                        spec_draft_model="llama-3.2-1b")))
    assert draft.offload_chunk_bytes > plain.offload_chunk_bytes
    assert draft.num_offload_chunks < plain.num_offload_chunks


def test_tensor_parallel_ranks_move_their_shares_at_once():
    """Under TP 2 each GPU holds half of a block and moves it over its own link: the same 2 MiB
    chunks (all GPUs), half the load time."""
    from simkv.config import HardwareConfig

    config = EngineConfig(CacheConfig(num_gpu_blocks=40, kv_offloading_size=1.0),
                          SchedulerConfig(max_model_len=512, max_num_batched_tokens=512),
                          hardware=HardwareConfig(tensor_parallel_size=2))
    stats = replay(_trace(), config).summary["kv_offloading"]
    assert stats["cpu_chunks"] == 512 and stats["load_bytes"] == 16 * 2 * 1024 * 1024
    assert stats["mean_load_s"] == pytest.approx(16 * 2 * 1024 * 1024 / 2 / 63e9, rel=1e-3)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_parallel_sampling_fans_out_with_offloading(async_scheduling):
    """Rows for n sequences fanned out (vLLM v1; checked step by step against vLLM's
    OffloadingConnector: scripts/oracle_offload.py --parallel): a member that finds the prompt in
    the CPU tier loads it like any request, decode runs change nothing, and every row completes
    with all its sequences. vLLM v0's forks are refused."""
    from tests.core.helpers import assert_decode_runs_change_nothing
    from simkv.traces.schema import read_trace

    import dataclasses

    import numpy as np

    trace = read_trace("traces/mooncake_synthetic_slice.parquet")
    n = [(1, 2, 1, 4)[i % 4] for i in range(len(trace))]
    trace = dataclasses.replace(trace, n=np.asarray(n, dtype=np.int64))
    config = EngineConfig(CacheConfig(num_gpu_blocks=800, kv_offloading_size=1.0),
                          SchedulerConfig(async_scheduling=async_scheduling))
    result = assert_decode_runs_change_nothing(trace, config)
    req = result.requests
    finished = (req["status"] == "finished").to_numpy()  # (the slice's prompts past max_model_len are rejected)
    assert result.summary["kv_offloading"]["loads"] > 0 and finished.sum() > len(n) // 2
    assert (req["status"] != "unfinished").all()
    assert (req["output_tokens"][finished] == (trace.output_tokens * np.asarray(n))[finished]).all()
    with pytest.raises(ValueError, match="without vLLM v0's forked parallel sampling"):
        replay(trace, EngineConfig(CacheConfig(num_gpu_blocks=800, kv_offloading_size=1.0),
                                   SchedulerConfig(parallel_sampling="fork")))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("options", [dict(), dict(kv_offloading_prompt_only=False, prefix_cache_retention_interval=None),
                                     dict(kv_offloading_block_size=32, prefix_cache_retention_interval=64)])
def test_decode_runs_change_nothing_with_offloading_and_sliding_windows(options, async_scheduling):
    """A model with sliding-window layers (core/kv_offload_hybrid.py): a window block the window
    gave back and a later step handed out again leaves the tier's stores as when stepping."""
    from tests.core.helpers import assert_decode_runs_change_nothing
    from simkv.traces.schema import read_trace

    trace = read_trace("traces/mooncake_synthetic_slice.parquet")
    config = EngineConfig.from_flat({"model": "gemma-2-9b", "sliding_window": 48, "num_gpu_blocks": 1200,
                                     "kv_offloading_size": 8.0, "async_scheduling": async_scheduling} | options)
    result = assert_decode_runs_change_nothing(trace, config)
    stats = result.summary["kv_offloading"]
    assert stats["loads"] > 0 and stats["stored_blocks"] > 0


def test_a_latent_every_tp_rank_holds_is_stored_once():
    """vLLM 0.33's replicated layout: a latent-attention model under TP alone, on one node, on
    CUDA, stores one copy of each chunk (rank 0 writes it, every rank loads it over its own
    link); otherwise a chunk holds every TP rank's copy. Same link time per chunk either way."""
    from simkv.capacity import compute_capacity, offload_copies

    def tier(**options):
        config = EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", tensor_parallel_size=8,
                                             kv_offloading_size=512.0) | options)
        return offload_copies(config), compute_capacity(config)

    copies, cap = tier()
    assert copies == 1 and cap.offload_chunk_bytes == -(-cap.block_bytes // 4096) * 4096
    assert cap.num_offload_chunks == 512 * 2**30 // cap.offload_chunk_bytes
    amd_copies, amd = tier(gpu="MI300X")  # (ROCm: each rank's private buffer)
    assert amd_copies == 8 and amd.offload_chunk_bytes >= 8 * amd.block_bytes
    assert tier(gpus_per_node=4)[0] == 8  # (TP over two nodes)
    assert tier(tensor_parallel_size=1, data_parallel_size=8)[0] == 1  # (one rank's own latent)
    gqa = EngineConfig.from_flat(dict(model="llama-3-8b", tensor_parallel_size=2, kv_offloading_size=64.0))
    assert offload_copies(gqa) == 2  # (each rank holds its own heads)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_cpu_tier_behind_pipeline_stages(async_scheduling):
    """Pipeline parallelism with KV offloading: the same tier (every stage's workers keep their
    layers' share of a chunk; vLLM sizes a chunk by the first stage's blocks times the workers),
    transfers on the stages' links at once, loads as a batch's first stage starts and stores
    once its last has ended; B loads A's prompt, and a group idle on the load waits for it."""
    from simkv.capacity import compute_capacity

    config = EngineConfig(CacheConfig(num_gpu_blocks=40, kv_offloading_size=1.0),
                          SchedulerConfig(max_model_len=512, max_num_batched_tokens=512,
                                          async_scheduling=async_scheduling),
                          HardwareConfig(pipeline_parallel_size=2))
    cap = compute_capacity(config)
    assert cap.pipeline_layers == (16, 16) and cap.offload_chunk_bytes == 2 * cap.block_bytes  # (2 MiB: as TP 1)
    result = replay(_trace(), config)
    stats = result.summary["kv_offloading"]
    assert stats["loads"] == 1 and stats["loaded_tokens"] == 256 and stats["stored_blocks"] == 7 * 16
    assert stats["mean_load_s"] == pytest.approx(16 * 2 * 1024 * 1024 / (2 * 63e9), rel=1e-3)  # (two links)
    assert result.summary["num_finished"] == 8
    b = result.requests.iloc[-1]
    assert b["ttft_s"] > stats["mean_load_s"]
    assert not result.run.scheduler.offload.has_finished_requests  # (retired once the queue drained)
    again = replay(_trace(), config)
    assert again.requests.equals(result.requests)


def _linear_trace():
    """A's 1,200-token prompt, six others that push its blocks out of a small pool, then B with
    A's prompt again (hash blocks of 16 tokens)."""
    shared = list(range(1, 76))
    rows = [(0.0, 1200, 4, shared)]
    rows += [(1.0 + i, 1200, 4, [1000 * (i + 1) + j for j in range(75)]) for i in range(6)]
    rows.append((20.0, 1200, 4, shared))
    df = pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens", "block_hashes"])
    df["hash_block_tokens"] = 16
    return trace_from_frame(df)


@pytest.mark.parametrize("options", [dict(), dict(async_scheduling=True),
                                     dict(speculative_method="mtp", num_speculative_tokens=2, async_scheduling=True)])
def test_the_cpu_tier_serves_a_linear_attention_model_its_state_and_its_chunks(options):
    """Qwen3-Next (3 Gated DeltaNet groups beside the attention group, 576-token blocks on 2
    H200s): A stores its attention chunks and, each in a job of its own, the states the GPU keeps
    (retention 0: the one at the prompt's last block boundary, 1,152). B, A's prompt again after
    A's blocks were evicted, loads the hit up to that state: 2 attention chunks and the 3 states,
    and computes only the rest. With MTP drafts the attention group holds the draft layer: the
    hit drops its last chunk (the drafter's KV there depends on the token after it) and ends at
    the state a block lower, which vLLM keeps under the eagle drop (576): a chunk and 3 states."""
    flat = {"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 2, "num_gpu_blocks": 24,
            "max_model_len": 4096} | options
    plain = replay(_linear_trace(), EngineConfig.from_flat(flat)).summary
    tiered = replay(_linear_trace(), EngineConfig.from_flat(flat | {"kv_offloading_size": 1.0}))
    stats = tiered.summary["kv_offloading"]
    assert plain["prefix_cache_hits_tokens"] == 0  # (A's blocks were evicted before B came)
    assert stats["chunk_tokens"] == 576 and stats["loads"] == 1
    hit, chunks = (576, 1) if options.get("speculative_method") else (1152, 2)
    assert stats["loaded_tokens"] == hit and stats["loaded_blocks"] == chunks + 3
    assert stats["stores"] == 7 * (1 + 3) and stats["stored_blocks"] == 7 * (2 + 3)  # (a job per state)
    assert tiered.summary["num_prefill_tokens"] == plain["num_prefill_tokens"] - hit
    assert tiered.summary["num_finished"] == 8


@pytest.mark.parametrize("options", [dict(), dict(async_scheduling=True), dict(kv_offloading_prompt_only=False),
                                     dict(kv_offloading_prompt_only=False, prefix_cache_retention_interval=None),
                                     dict(kv_offloading_prompt_only=False, prefix_cache_retention_interval=None,
                                          async_scheduling=True),
                                     dict(speculative_method="mtp", num_speculative_tokens=2)])
def test_decode_runs_change_nothing_with_offloading_on_linear_attention(options):
    """Qwen3-Next with a CPU tier (core/kv_offload_mamba.py): jumping over decode runs leaves the
    tier's loads, stores and every request as stepping one by one makes them, decode states
    stored too (a run stops short of a step where a decoder completes a chunk)."""
    from tests.core.helpers import assert_decode_runs_change_nothing
    from simkv.traces.schema import read_trace

    trace = read_trace("traces/mooncake_synthetic_slice.parquet")
    config = EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 2,
                                     "num_gpu_blocks": 400, "max_model_len": 32768, "kv_offloading_size": 16.0}
                                    | options)
    stats = assert_decode_runs_change_nothing(trace, config).summary["kv_offloading"]
    assert stats["loads"] > 0 and stats["stored_blocks"] > 0


def _pd(prefill=(), decode=()):
    from simkv.replay.disaggregated import DisaggregationSpec

    return DisaggregationSpec(1, 1, prefill_options=tuple(prefill), decode_options=tuple(decode))


def test_a_prefill_pool_tier_serves_a_prompt_its_gpu_cache_lost():
    """P/D with a CPU tier on the prefill pool (vLLM's MultiConnector, NIXL then offloading): B's
    prefill loads A's prompt from the tier; the decode pool has no tier and pulls every prompt."""
    res = replay(_trace(), _config(), disaggregation=_pd(prefill=[("kv_offloading_size", 1.0)]))
    pools = res.summary["disaggregation"]
    tier = pools["prefill"]["kv_offloading"]
    assert tier["loads"] == 1 and tier["loaded_tokens"] == 256 and tier["stored_blocks"] == 7 * 16
    assert "kv_offloading" not in pools["decode"] and "kv_offloading" not in res.summary
    assert pools["kv_transfer"]["num_pulls"] == 8
    plain = replay(_trace(), _config(), disaggregation=_pd()).summary["disaggregation"]
    assert pools["prefill"]["num_prefill_tokens"] == plain["prefill"]["num_prefill_tokens"] - 255


def test_pulls_never_load_from_a_decode_pool_tier():
    """On the decode pool NIXL claims every pull before the tier (it comes first): B pulls A's
    prompt again although the decode tier holds it; the tier stores each pulled prompt once."""
    res = replay(_trace(), _config(), disaggregation=_pd(decode=[("kv_offloading_size", 1.0)]))
    pools = res.summary["disaggregation"]
    tier = pools["decode"]["kv_offloading"]
    assert tier["loads"] == 0 and tier["stored_blocks"] == 7 * 16
    assert pools["kv_transfer"]["num_pulls"] == 8 and "kv_offloading" not in pools["prefill"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_runs_change_nothing_with_tiers_on_both_pools(async_scheduling):
    """Both pools with a tier, busy enough to preempt (a preempted decoder recomputes locally and
    may load from the decode pool's tier): decode-run jumps give the same summary as stepping,
    and a second replay the same bytes."""
    rng = np.random.default_rng(3)
    n = 60
    prefixes = [[1000 * k + j for j in range(40)] for k in range(4)]
    prompts = rng.integers(64, 600, n)
    df = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 3, n)), "prompt_tokens": prompts,
                       "output_tokens": rng.integers(20, 300, n)})
    df["block_hashes"] = [prefixes[int(rng.integers(0, 4))][:-(-int(p) // 16)] for p in prompts]
    df["hash_block_tokens"] = 16
    trace = trace_from_frame(df)
    config = EngineConfig(CacheConfig(num_gpu_blocks=120), SchedulerConfig(
        max_model_len=1024, max_num_batched_tokens=512, async_scheduling=async_scheduling))
    spec = _pd(prefill=[("kv_offloading_size", 0.05)], decode=[("kv_offloading_size", 0.05)])
    runs = replay(trace, config, disaggregation=spec).summary
    steps = replay(trace, config, disaggregation=spec, use_decode_runs=False).summary
    again = replay(trace, config, disaggregation=spec).summary
    for s in (runs, steps, again):
        s.pop("wall_time_s")
    pools = runs["disaggregation"]
    assert pools["decode"]["num_preemptions"] > 0 and pools["prefill"]["kv_offloading"]["loads"] > 0
    assert json.dumps(runs, sort_keys=True, default=str) == json.dumps(steps, sort_keys=True, default=str)
    assert json.dumps(runs, sort_keys=True, default=str) == json.dumps(again, sort_keys=True, default=str)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pd_tiers_with_clients_that_give_up(async_scheduling):
    """P/D with a tier on each pool and clients that give up on a first token after 2 s and retry
    once (the prefill router resends): every attempt ends, finished or timed out, and the decode
    pool's tier serves its preempted decoders' recomputes."""
    rng = np.random.default_rng(5)
    n = 120
    df = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 4, n)), "prompt_tokens": rng.integers(200, 900, n),
                       "output_tokens": rng.integers(50, 400, n)})
    df["block_hashes"] = [list(range(10_000 * i, 10_000 * i + -(-int(p) // 16))) for i, p in
                          enumerate(df["prompt_tokens"])]
    df["hash_block_tokens"] = 16
    config = EngineConfig(CacheConfig(num_gpu_blocks=300), SchedulerConfig(
        max_model_len=1024, max_num_batched_tokens=512, async_scheduling=async_scheduling,
        client_ttft_timeout_s=2.0, client_max_retries=1))
    spec = _pd(prefill=[("kv_offloading_size", 0.05)], decode=[("kv_offloading_size", 0.05)])
    res = replay(trace_from_frame(df), config, disaggregation=spec)
    s = res.summary
    assert s["num_finished"] + s["client"]["timed_out_requests"] == n and s["client"]["retries"] > 0
    decode = s["disaggregation"]["decode"]
    assert decode["num_preemptions"] > 0 and decode["kv_offloading"]["loads"] > 0


@pytest.mark.parametrize("chunk_tokens, blocks_per_chunk", [(None, 1), (64, 2)])
def test_decode_context_parallel_chunks_are_manager_blocks(chunk_tokens, blocks_per_chunk):
    """deepseek-v2-lite at TP 2 with DCP 2: the KV-cache manager's blocks hold 32 tokens, each GPU
    16 of them, and a chunk is `blocks_per_chunk` of those blocks. vLLM 0.33 keeps one copy of a
    latent all TP ranks hold only without DCP: here each GPU stores its own page, so a chunk is
    twice the DCP-free one's bytes, and a load moves each half over its own GPU's link. B still
    loads A's whole prompt (8 manager blocks); a chunk size off the manager's block is refused."""
    from simkv.capacity import compute_capacity

    def config(dcp, **cache):
        return EngineConfig.from_flat({"model": "deepseek-v2-lite", "tensor_parallel_size": 2,
                                       "decode_context_parallel_size": dcp, "max_model_len": 512,
                                       "max_num_batched_tokens": 512, "kv_offloading_size": 1.0} | cache)

    extra = {"kv_offloading_block_size": chunk_tokens} if chunk_tokens else {}
    plain, dcp = config(1, num_gpu_blocks=40), config(2, num_gpu_blocks=20, **extra)
    one, two = compute_capacity(plain), compute_capacity(dcp)
    assert two.block_bytes == one.block_bytes  # (one GPU's block: 16 tokens of the latent)
    assert two.offload_chunk_bytes == 2 * one.block_bytes * blocks_per_chunk
    a, b = replay(_trace(), plain).summary["kv_offloading"], replay(_trace(), dcp).summary["kv_offloading"]
    assert a["loaded_tokens"] == b["loaded_tokens"] == 256 and (a["loaded_blocks"], b["loaded_blocks"]) == (16, 8)
    assert b["load_bytes"] == 8 * 2 * one.block_bytes
    assert b["mean_load_s"] == pytest.approx(b["load_bytes"] / 2 / 63e9, rel=1e-3)
    with pytest.raises(ConfigError, match="multiple of the KV-cache manager's block"):
        config(2, kv_offloading_block_size=48)
