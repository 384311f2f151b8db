"""Mixture-of-experts model specs: parameters, weight bytes, the roofline's expert reads, capacity."""

import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner

from simkv.backends.factory import make_backend
from simkv.backends.roofline import RooflineCostModel
from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.core.outputs import ScheduledChunk, SchedulerOutput
from simkv.specs import get_gpu_spec, get_model_spec
from tests.core.helpers import make_request


def test_published_sizes():
    """gpt-oss-120b: 116.8B parameters, a 60.8 GiB checkpoint (MXFP4 experts); gpt-oss-20b: 20.9B,
    12.8 GiB; Qwen3-30B-A3B: 30.5B, 3.3B active (the model cards' figures)."""
    big, small, qwen = (get_model_spec(m) for m in ("gpt-oss-120b", "gpt-oss-20b", "qwen3-30b-a3b"))
    assert big.num_params / 1e9 == pytest.approx(116.8, abs=0.1)
    assert big.weight_bytes / 2**30 == pytest.approx(60.8, abs=0.2)
    assert small.num_params / 1e9 == pytest.approx(20.9, abs=0.1)
    assert small.weight_bytes / 2**30 == pytest.approx(12.8, abs=0.1)
    assert qwen.num_params / 1e9 == pytest.approx(30.5, abs=0.1)
    assert qwen.num_active_params / 1e9 == pytest.approx(3.35, abs=0.05)
    mixtral = get_model_spec("mixtral-8x7b")  # (46.7B, 12.9B active: Mistral's figures)
    assert mixtral.num_params / 1e9 == pytest.approx(46.7, abs=0.05)
    assert mixtral.num_active_params / 1e9 == pytest.approx(12.9, abs=0.05)
    dense = get_model_spec("llama-3-8b")
    assert dense.num_active_params == dense.num_params and dense.weight_bytes == 2 * dense.num_params


@pytest.mark.parametrize("model, billions", [("llama-3.2-1b", 1.24), ("qwen2.5-0.5b", 0.49), ("gemma-2-9b", 9.24),
                                             ("gemma-3-12b", 11.77), ("gemma-3-27b", 27.01), ("llama-3-8b", 8.03)])
def test_tied_embeddings_count_once(model, billions):
    """Models whose LM head is their embedding matrix hold it once (the model cards' sizes; Gemma 3's
    language model without its 0.4B vision tower); the roofline still reads the LM head every step."""
    spec = get_model_spec(model)
    assert spec.num_params / 1e9 == pytest.approx(billions, abs=0.01)
    untied = dataclasses.replace(spec, tie_word_embeddings=False)
    tied = dataclasses.replace(spec, tie_word_embeddings=True)
    assert untied.num_params - tied.num_params == spec.vocab_size * spec.hidden_size
    gpu = get_gpu_spec("H100-SXM")
    assert RooflineCostModel(tied, gpu).weight_bytes == RooflineCostModel(untied, gpu).weight_bytes


def test_experts_touched():
    qwen = get_model_spec("qwen3-30b-a3b")  # 128 experts, 8 per token
    assert qwen.experts_touched(1) == pytest.approx(8)
    assert qwen.experts_touched(2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert qwen.experts_touched(10_000) == pytest.approx(128)
    assert np.allclose(qwen.experts_touched(np.array([1, 2])), [qwen.experts_touched(1), qwen.experts_touched(2)])


def _decodes(n: int, context: int = 1000) -> SchedulerOutput:
    chunks = [ScheduledChunk(make_request(i, context + 1, 1), context, 1) for i in range(n)]
    return SchedulerOutput(step=0, chunks=chunks, num_decode_reqs=0, decode_context_tokens=0, decodes=None,
                           preempted=[], num_running=n, num_waiting=0, num_blocks_used=0, prefix_query_tokens=0,
                           prefix_hit_tokens=0)


def test_roofline_reads_the_experts_the_tokens_touch():
    """qwen3-30b-a3b on one H100, pure decode (memory-bound): one request reads the non-expert
    weights and 8 experts per layer; the step time follows the expected expert count."""
    config = EngineConfig.from_flat(dict(model="qwen3-30b-a3b", num_gpu_blocks=1000, max_model_len=4096))
    model = make_backend("roofline", config)
    spec, gpu = get_model_spec("qwen3-30b-a3b"), get_gpu_spec("H100-SXM")
    rate = gpu.mem_bandwidth_gbs * 1e9 * 0.8
    h, v = spec.hidden_size, spec.vocab_size
    dense = 2.0 * (spec.num_dense_params - 2 * v * h - h + h * v)
    kv = spec.kv_bytes_per_token(2) * (1000 + 1 + 1)
    expected = (dense + 2.0 * spec.expert_params * spec.num_layers * spec.experts_touched(1) + kv) / rate
    assert model.execute(_decodes(1)) == pytest.approx(expected + 1e-3 + 5e-6)
    one, many = model.execute(_decodes(1)), model.execute(_decodes(64))
    all_experts = (dense + 2.0 * spec.expert_params * spec.num_layers * 128) / rate
    assert one < many < all_experts + 64 * kv / rate + 1e-3 + 64 * 5e-6 + 1e-9


def test_capacity_counts_mxfp4_weights():
    """gpt-oss-120b fits one H100 (80 GB) because its experts are MXFP4; its blocks hold one of its
    two KV-cache groups (18 layers of 8 KV heads x 64 x 2 bytes x K and V)."""
    cap = compute_capacity(EngineConfig.from_flat(dict(model="gpt-oss-120b", gpu="H100-SXM")))
    assert cap.block_bytes == 18 * 2 * 8 * 64 * 2 * 16
    assert 20_000 < cap.num_gpu_blocks < 22_000
    res = CliRunner().invoke(main, ["capacity", "--model", "gpt-oss-120b", "--json"])
    assert res.exit_code == 0, res.output
    import json

    rep = json.loads(res.output)
    assert rep["weight_bytes_per_gpu"] / 2**30 == pytest.approx(60.7, abs=0.1) and rep["num_gpu_blocks"] == cap.num_gpu_blocks
    res = CliRunner().invoke(main, ["replay", "--model", "gpt-oss-20b", "--backend", "gpu", "--device", "cpu"])
    assert res.exit_code != 0 and "simulated only" in res.output
    res = CliRunner().invoke(main, ["calibrate", "--model", "qwen3-30b-a3b", "--device", "cpu"])
    assert res.exit_code != 0 and "simulated only" in res.output


def test_eagle_head_of_a_mixture_of_experts():
    """gpt-oss-120b's published EAGLE-3 head is one dense Llama layer (MLP 17,280 wide, bf16), not
    a layer with 128 experts: its weights are those of that layer (the embeddings and LM head are
    the target's), it attends the whole context, and the pool loses what it holds plus the 19th
    layer per block. A mixture of experts without a known head keeps the target-shaped layer."""
    eagle = {"speculative_method": "eagle3", "num_speculative_tokens": 3}
    config = EngineConfig.from_flat(dict(model="gpt-oss-120b", gpu="H100-SXM") | eagle)
    target = get_model_spec("gpt-oss-120b")
    head = config.speculative.draft_spec(target)
    assert (head.num_layers, head.num_experts, head.intermediate_size, head.sliding_window) == (1, 0, 17_280, 0)
    attention = 2880 * 64 * 64 * 2 + 2 * 2880 * 8 * 64  # q and o, k and v
    assert head.weight_bytes - 2 * head.embedding_params == pytest.approx(2 * (attention + 3 * 2880 * 17_280), rel=0.01)
    plain = compute_capacity(EngineConfig.from_flat(dict(model="gpt-oss-120b", gpu="H100-SXM")))
    with_head = compute_capacity(config)
    assert with_head.block_bytes == plain.block_bytes * 19 // 18
    freed = plain.num_gpu_blocks * plain.block_bytes - with_head.num_gpu_blocks * with_head.block_bytes
    assert freed == pytest.approx(head.weight_bytes - 2 * head.embedding_params, rel=0.01)
    qwen = EngineConfig.from_flat(dict(model="qwen3-30b-a3b") | eagle)
    assert qwen.speculative.draft_spec(get_model_spec("qwen3-30b-a3b")).num_experts == 128
