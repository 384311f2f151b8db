"""Chunked local attention (Llama 4): its KV-cache groups, the coordinator's chunk rules against
vLLM's recorded steps, the attended context, capacity, the Llama 4 specs and config import."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.backends.base import chunk_pairs_and_reads
from simkv.backends.factory import make_backend
from simkv.capacity import compute_capacity, group_blocks_per_request
from simkv.config import ConfigError, EngineConfig
from simkv.core.kv_cache_coordinator import KVCacheCoordinator
from simkv.core.outputs import ScheduledChunk, SchedulerOutput
from simkv.specs import get_model_spec
from simkv.specs.hf_config import ModelConfigError, spec_fields_from_config
from simkv.traces.schema import trace_from_frame
from tests.core.helpers import (assert_decode_runs_change_nothing, assert_same_async_replay_as_vllm,
                                assert_same_steps_as_vllm, decode_contexts, make_request)

DATA = Path(__file__).parents[1] / "core" / "data"
CHUNKED = dict(model="gemma-2-9b", gpu="H100-SXM", attention_chunk_size=16, full_attention_interval=2)


@pytest.mark.parametrize("index", range(8))
def test_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_hybrid.py --chunked: vLLM 0.33's scheduler with
    ChunkedLocalAttentionSpec groups (chunks of 2 to 40 tokens beside full-attention groups,
    caching off in two): every step's scheduled tokens, running, waiting and blocks in use, every
    request's first-token and finish step, prefix-cache queries and hits."""
    case = json.loads((DATA / "chunked_vllm_cases.json").read_text())["cases"][index]
    assert case["case"]["group_chunked"] and any(case["case"]["group_windows"])
    ours = assert_same_steps_as_vllm(case)
    stats = ours["scheduler"].kv_cache_manager.prefix_cache_stats
    assert [stats.queries, stats.hits] == case["vllm"]["prefix"]


@pytest.mark.parametrize("index", range(6))
def test_same_steps_as_vllm_async(index, tmp_path):
    """Recorded cases of scripts/oracle_hybrid_async.py --chunked (the 6 with the most preemptions
    of 24): vLLM 0.33's AsyncScheduler, two batches deep, 1 s steps; chunks freed on the processed
    tokens. Steps, first-token and finish times, preemptions and prefix hits are vLLM's."""
    config = assert_same_async_replay_as_vllm(json.loads((DATA / "chunked_async_vllm_cases.json").read_text())[index],
                                              tmp_path)
    assert config.kv_cache_groups.chunked


def test_a_chunk_is_given_back_when_the_next_starts():
    """Chunk 8, block 4: a request holds the blocks of its current chunk only (the full group all)."""
    kv = KVCacheCoordinator(100, 4, 64, (8, 0), chunked=True)
    request = make_request(0, 30, 5)
    kv.allocate_slots(request, 0, 30)
    local, full = kv._tables[0]
    assert len(full) == 8 and len(local) == 8
    kv.allocate_slots(request, 30, 1, num_processed_tokens=30)  # computed 30: chunk [24, 32) attends
    local = kv._tables[0][0]
    assert local[:6] == [kv.null_block] * 6 and kv.null_block not in local[6:]
    assert kv.next_decode_event(request) == 32  # the next chunk start


def test_a_hit_needs_only_the_blocks_of_its_last_chunk():
    """vLLM's ChunkedLocalAttentionManager: blocks below the hit's chunk count as computed (null);
    from there the blocks must be cached. Chunk 8, block 4, a 24-token shared prompt."""
    kv = KVCacheCoordinator(100, 4, 64, (8, 0), chunked=True)
    first = make_request(0, 25, 1, [1, 2, 3, 4, 5, 6], 4)
    kv.allocate_slots(first, 0, 25)
    kv.free(first, 25, finished=True)
    second = make_request(1, 25, 1, [1, 2, 3, 4, 5, 6], 4)
    hit = kv.get_computed_blocks(second)
    assert hit.num_tokens == 24  # a chunk boundary: the local group needs no block at all
    assert hit.blocks[0] == [kv.null_block] * 6 and len(hit.blocks[1]) == 6
    third = make_request(2, 23, 1, [1, 2, 3, 4, 5, 6], 4)  # hit 20 tokens: chunk [16, 24) needs block 4
    hit = kv.get_computed_blocks(third)
    assert hit.num_tokens == 20 and hit.blocks[0][:4] == [kv.null_block] * 4 and kv.null_block not in hit.blocks[0][4:]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 60), c=st.integers(0, 80), chunk=st.integers(1, 20))
def test_chunk_pairs_and_reads_count_each_token(n, c, chunk):
    pairs = sum(p - p // chunk * chunk + 1 for p in range(c, c + n))
    reads = len(range(c // chunk * chunk, c + n))
    assert chunk_pairs_and_reads(n, c, chunk) == (pairs, reads)


def test_decode_context_is_the_chunk_so_far():
    """Full-attention layers attend every token, local ones the tokens of their chunk (chunk 8)."""
    config = EngineConfig.from_flat(CHUNKED | dict(attention_chunk_size=8, block_size=4, max_model_len=64,
                                                   num_gpu_blocks=200))
    layers = config.layer_windows
    full, local = layers.count(0), len(layers) - layers.count(0)
    contexts = decode_contexts(config, make_request(0, 5, 14))
    # decodes at 5..17 cached tokens: the local layers attend 6, 7, 8, 1, 2, ..., 8, 1, 2
    assert contexts == [full * (c + 1) + local * (c - c // 8 * 8 + 1) for c in range(5, 18)]
    backend = make_backend("roofline", config)
    step = SchedulerOutput(step=0, chunks=[], num_decode_reqs=1, decode_context_tokens=contexts[-1], decodes=None,
                           preempted=[], num_running=1, num_waiting=0, num_blocks_used=0, prefix_query_tokens=0,
                           prefix_hit_tokens=0)
    chunk = ScheduledChunk(make_request(0, 18, 1), 17, 1)
    as_chunk = SchedulerOutput(step=0, chunks=[chunk], num_decode_reqs=0, decode_context_tokens=0, decodes=None,
                               preempted=[], num_running=1, num_waiting=0, num_blocks_used=0, prefix_query_tokens=0,
                               prefix_hit_tokens=0)
    assert backend.execute(step) == pytest.approx(backend.execute(as_chunk), rel=1e-12)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), chunk=st.sampled_from([2, 5, 16, 40, 300]), interval=st.sampled_from([2, 6]),
       block_size=st.sampled_from([4, 16]), blocks=st.sampled_from([0, 40, 400]), caching=st.booleans(),
       async_=st.booleans())
def test_decode_runs_change_nothing(seed, chunk, interval, block_size, blocks, caching, async_):
    """Steady decoders under chunked local attention (a chunk start is an event, the context counted
    per layer): jumping over decode runs gives the steps and requests stepping one by one gives."""
    rng = np.random.default_rng(seed)
    n = 40
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 2, n)), "prompt_tokens": rng.integers(1, 700, n),
                          "output_tokens": rng.integers(1, 300, n)})
    opts = CHUNKED | dict(attention_chunk_size=chunk, full_attention_interval=interval, block_size=block_size,
                          max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512,
                          enable_prefix_caching=caching, async_scheduling=async_)
    config = EngineConfig.from_flat(opts)
    if blocks:
        config = EngineConfig.from_flat(opts | {"num_gpu_blocks": group_blocks_per_request(config, 1024, startup=True)
                                                + blocks})
    a = assert_decode_runs_change_nothing(trace_from_frame(frame), config)
    assert a.summary["num_finished"] == n


def test_llama_4_specs_and_capacity():
    """Scout: 107.8B parameters (17.2B active) in the text decoder, 3 of 4 layers chunked over 8,192
    tokens: the local groups hold at most a chunk and a batch, so the cache keeps far more tokens
    than full attention on every layer would."""
    scout = get_model_spec("llama-4-scout")
    assert round(scout.num_params / 1e9, 1) == 107.8 and round(scout.num_active_params / 1e9, 1) == 17.2
    maverick = get_model_spec("llama-4-maverick")
    assert round(maverick.num_params / 1e9) == 401 and round(maverick.num_active_params / 1e9, 1) == 17.2
    base = dict(model="llama-4-scout", gpu="H100-SXM", tensor_parallel_size=8, max_model_len=131072)
    config = EngineConfig.from_flat(base)
    assert config.kv_cache_groups.summary() == "3 x chunked_local_attention(8192) + 1 x full_attention"
    flat = EngineConfig.from_flat(base | {"disable_hybrid_kv_cache_manager": True})
    hybrid, whole = compute_capacity(config), compute_capacity(flat)
    assert hybrid.block_bytes * 4 == whole.block_bytes  # a block holds one group's 12 layers
    assert hybrid.num_gpu_blocks == hybrid.available_kv_bytes // hybrid.block_bytes
    # admission caps a local group at ceil(min(chunk + in-flight tokens, max_model_len) / block)
    per_request = group_blocks_per_request(config, 131072, startup=True)
    assert per_request == 3 * (8192 + 8192) // 16 + 131072 // 16
    # 131,072-token requests at once: 45.7 (vLLM's "maximum concurrency") against 15.7
    assert hybrid.num_gpu_blocks / per_request > 2.9 * whole.num_gpu_blocks / (131072 // 16)


def test_eagle_turns_the_hybrid_manager_off():
    """vLLM disables its hybrid manager for chunked local attention with an EAGLE drafter."""
    config = EngineConfig.from_flat(dict(model="llama-4-scout", tensor_parallel_size=8, max_model_len=16384,
                                         speculative_method="eagle3", num_speculative_tokens=2))
    assert config.kv_cache_groups.summary() == "1 x full_attention"
    assert config.layer_windows.count(8192) == 36  # (the layers still attend their chunks)


@pytest.mark.parametrize("options, message", [
    (CHUNKED | {"full_attention_interval": 0}, "every layer local"),
    (CHUNKED | {"sliding_window": 8}, "one kind of local attention"),
    (CHUNKED | {"prefix_cache_retention_interval": 16}, "no sliding-window or Mamba"),
    (CHUNKED | {"tensor_parallel_size": 16, "decode_context_parallel_size": 2}, "DCP not support chunked local attn now"),
])
def test_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(options)


def _llama4_config(tmp_path, **text):
    fields = {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
              "num_local_experts": 128, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
              "vocab_size": 202048, "max_position_embeddings": 1048576, "attention_chunk_size": 8192,
              "tie_word_embeddings": False} | text
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama4", "text_config": fields}))
    return str(path)


def test_llama_4_config_import(tmp_path):
    """Maverick's config.json gives the shipped spec's fields: experts every 2nd layer with a shared
    expert, dense layers of intermediate_size_mlp, chunks on 3 of 4 layers."""
    fields = spec_fields_from_config(_llama4_config(tmp_path))
    shipped = get_model_spec("llama-4-maverick")
    for key, value in fields.items():
        assert getattr(shipped, key) == value, key
    odd = [1, 1, 0, 1, 1, 1] * 8  # full layers at 2, 8, 14, ...: not one every k layers
    (tmp_path / "odd").mkdir()
    with pytest.raises(ModelConfigError, match="no_rope_layers"):
        spec_fields_from_config(_llama4_config(tmp_path / "odd", no_rope_layers=odd))


def test_pd_disaggregation_pulls_only_the_last_attention_chunk_of_local_groups():
    """P/D pools of a chunked-local model (the engine core checked against vLLM:
    tests/core/test_remote_kv.py): a pull moves the full-attention group's blocks of the whole
    prompt and the local group's from the start of the prompt's last attention chunk on (one
    block here); without the hybrid manager every layer's blocks of the whole prompt."""
    from simkv.replay.api import replay
    from simkv.replay.disaggregated import DisaggregationSpec
    from simkv.traces.schema import trace_from_frame

    prompts = [100, 300]
    trace = trace_from_frame(pd.DataFrame([(0.0, prompts[0], 3), (0.5, prompts[1], 4)],
                                          columns=["arrival_time_s", "prompt_tokens", "output_tokens"]))
    hybrid = EngineConfig.from_flat(CHUNKED)
    plain = EngineConfig.from_flat(CHUNKED | {"disable_hybrid_kv_cache_manager": True})
    pulled = {}
    for name, config in (("hybrid", hybrid), ("plain", plain)):
        res = replay(trace, config, disaggregation=DisaggregationSpec(1, 1))
        assert list(res.requests["status"]) == ["finished", "finished"]
        pulled[name] = list(res.requests["kv_pull_bytes"])
    block = compute_capacity(hybrid).block_bytes  # (one block of either group's layers)
    assert pulled["hybrid"] == [(-(-p // 16) + 1) * block for p in prompts]
    assert pulled["plain"] == [-(-p // 16) * compute_capacity(plain).block_bytes for p in prompts]
