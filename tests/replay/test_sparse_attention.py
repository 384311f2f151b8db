"""DeepSeek sparse attention (DeepSeek-V3.2's DSA): the indexer's keys cached beside the latent,
each query attending its top-k tokens, and the roofline's price of both."""

import json
import itertools
from pathlib import Path

import pytest
from click.testing import CliRunner

from simkv.backends.drafting import Drafter
from simkv.backends.factory import make_roofline
from simkv.backends.roofline import RooflineCostModel, capped_pairs
from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig
from simkv.core.outputs import ScheduledChunk, ScheduledDecode
from simkv.replay.api import replay
from simkv.specs import get_gpu_spec, get_model_spec
from simkv.traces.schema import read_trace
from tests.core.helpers import make_request, make_step
from tests.replay.test_mla_models import DEEPSEEK_V3

V32 = {"model": "deepseek-v3.2", "gpu": "H200", "tensor_parallel_size": 8}
TRACES = Path(__file__).parents[2] / "traces"


def test_the_cache_holds_the_latent_and_the_indexer_key():
    """Per token and layer: bf16 latent and rotary key 1,152 B, or vLLM's fp8_ds_mla layout 656 B
    (512 fp8, four float32 scales, the rotary key bf16), plus the indexer's 128 fp8 values and
    one float32 scale, 132 B; vLLM's sparse kernels take 64-token blocks."""
    spec = get_model_spec("deepseek-v3.2")
    assert spec.kv_bytes_per_token(2) == 61 * (1152 + 132) == 78_324
    assert spec.kv_bytes_per_token("fp8_ds_mla") == 61 * (656 + 132) == 48_068
    assert spec.kv_bytes_per_token(1) == 61 * (576 + 132)  # (plain fp8 latents: FlashInfer's and AITER's)
    assert get_model_spec("deepseek-v3").kv_bytes_per_token(2) == 61 * 1152
    bf16 = compute_capacity(EngineConfig.from_flat(V32))
    fp8 = compute_capacity(EngineConfig.from_flat(V32 | {"kv_cache_dtype": "fp8"}))
    assert bf16.block_size == fp8.block_size == 64
    assert bf16.block_bytes == 64 * 78_324 and fp8.block_bytes == 64 * 48_068
    assert fp8.num_gpu_blocks == pytest.approx(bf16.num_gpu_blocks * 78_324 / 48_068, rel=1e-3)


def test_the_indexer_is_replicated_on_every_gpu():
    """vLLM builds the indexer's projections unsplit (ReplicatedLinear, disable_tp): each GPU
    holds them whole, the query's in fp8, the fused key and head-weight projection bf16."""
    v3, v32 = get_model_spec("deepseek-v3"), get_model_spec("deepseek-v3.2")
    per_layer = 1536 * 64 * 128 + 7168 * (128 + 64)
    assert v32.indexer_params == 61 * per_layer
    indexer_bytes = 61 * (1536 * 64 * 128 + 2 * 7168 * (128 + 64))
    assert v32.weight_bytes - v3.weight_bytes == pytest.approx(indexer_bytes)
    for tp in (1, 8):
        assert v32.weight_bytes_per_gpu(tp) - v3.weight_bytes_per_gpu(tp) == pytest.approx(indexer_bytes)


def test_a_config_with_an_indexer_is_the_shipped_spec(tmp_path):
    path = tmp_path / "v32.json"
    path.write_text(json.dumps(DEEPSEEK_V3 | {"index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}))
    imported, shipped = get_model_spec(str(path)), get_model_spec("deepseek-v3.2")
    for field in ("index_topk", "index_n_heads", "index_head_dim", "num_params", "num_active_params"):
        assert getattr(imported, field) == getattr(shipped, field), field
    assert imported.kv_bytes_per_token(2) == shipped.kv_bytes_per_token(2)


@pytest.mark.parametrize("computed, new, cap", list(itertools.product((0, 1, 5, 9, 30), (1, 2, 7, 40), (1, 8, 16))))
def test_capped_pairs_count_each_query_at_most_cap(computed, new, cap):
    assert capped_pairs(computed, new, cap) == sum(min(p, cap) for p in range(computed + 1, computed + new + 1))


def _decodes(step, contexts, topk=2048):
    """`step`'s decodes of `contexts` cached tokens each, and their tokens attended (as the
    scheduler counts them)."""
    step.decodes = [ScheduledDecode(make_request(i, c, 10), c) for i, c in enumerate(contexts)]
    step.decode_capped_context_tokens = sum(min(c + 1, topk) for c in contexts)
    return step


def test_a_long_context_decode_reads_its_top_k_and_every_indexer_key():
    """Past top-k a decode's latent reads and attention pairs stop growing; the indexer's keys and
    scores go on, so a 100k-token decode step costs a fraction of dense latent attention's."""
    gpu = get_gpu_spec("H200")
    dense = RooflineCostModel(get_model_spec("deepseek-v3"), gpu, 8)
    sparse = RooflineCostModel(get_model_spec("deepseek-v3.2"), gpu, 8, block_size=64)
    assert not sparse.needs_request_detail and sparse.supports_decode_runs and sparse.capped_line_slopes
    contexts = [100_000] * 64
    step = _decodes(make_step(decodes=64, context=sum(c + 1 for c in contexts)), contexts)
    tokens, seqs, pairs, reads, latent_pairs, upproj = sparse.step_work(step)
    assert (tokens, seqs, pairs, upproj) == (64, 64, 0, 0)
    assert latent_pairs == pytest.approx(64 * (2048 + 100_001 * sparse.indexer_pair_ratio))
    assert reads == pytest.approx(64 * (2048 * sparse.latent_read_share + 100_001 * sparse.indexer_read_share))
    assert sparse.execute(step) < 0.35 * dense.execute(step)
    short = [1_000] * 64
    near = _decodes(make_step(decodes=64, context=sum(c + 1 for c in short)), short)
    assert sparse.execute(near) == pytest.approx(dense.execute(near), rel=0.05)


def test_prefills_go_dense_while_none_is_longer_than_top_k():
    """vLLM 0.33 runs a step's prefills as dense MHA (the expanded path) when none reaches past
    top-k tokens, and then, with no decode in the step, its indexer scores nothing; otherwise
    every prefill query attends its top-k down the latent path, and the indexer scores it."""
    sparse = RooflineCostModel(get_model_spec("deepseek-v3.2"), get_gpu_spec("H200"), 8, block_size=64)
    short = ScheduledChunk(make_request(0, 2000, 5), 500, 1500)
    long = ScheduledChunk(make_request(1, 9000, 5), 1000, 4000)
    causal_short = 1500 * 500 + 1500 * 1501 // 2
    causal_long = 4000 * 1000 + 4000 * 4001 // 2
    tokens, _, pairs, reads, latent_pairs, upproj = sparse.step_work(make_step([short]))
    assert (tokens, pairs, upproj, reads, latent_pairs) == (1500, causal_short, 500, 2000, 0)
    with_decode = _decodes(make_step([short], decodes=1, context=101), [100])
    _, _, pairs, _, latent_pairs, _ = sparse.step_work(with_decode)
    assert pairs == causal_short
    assert latent_pairs == pytest.approx(101 + (causal_short + 101) * sparse.indexer_pair_ratio)
    tokens, _, pairs, reads, latent_pairs, upproj = sparse.step_work(make_step([short, long]))
    assert (tokens, pairs, upproj, reads) == (5500, 0, 0, 7000)
    attended = capped_pairs(500, 1500, 2048) + capped_pairs(1000, 4000, 2048)
    assert attended == causal_short + 1048 * (1048 + 1) // 2 + 1048 * 1000 + (4000 - 1048) * 2048
    assert latent_pairs == pytest.approx(attended + (causal_short + causal_long) * sparse.indexer_pair_ratio)


@pytest.mark.parametrize("options, message", [
    (V32 | {"block_size": 16}, "blocks of a multiple of 64 tokens: block_size 16"),
    (V32 | {"gpu": "A100-80GB"}, "no sparse MLA backend for A100-80GB"),
    (V32 | {"decode_context_parallel_size": 8}, "not modelled with decode_context_parallel_size"),
])
def test_what_sparse_attention_is_refused_with(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(options)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_sparse_replay_jumps_decode_runs_without_changing_a_byte(tmp_path, async_scheduling):
    """Top-k caps each request's own context: the scheduler counts the decoders' attended tokens
    as a window's (those below top-k, the steps they reach it), so decode runs jump over steps
    and write the same bytes as stepping every decode; the replay is whole and repeatable, and
    DP ranks and P/D pools run it."""
    from simkv.core.scheduler import Scheduler
    from tests.core.helpers import assert_decode_runs_change_no_bytes

    trace = read_trace(TRACES / "req400.parquet")
    config = EngineConfig.from_flat(V32 | {"async_scheduling": async_scheduling})
    first = assert_decode_runs_change_no_bytes(trace, config, tmp_path / "runs")
    again = replay(trace, config).summary
    for s in (first.summary, again):
        s.pop("wall_time_s", None)
    assert json.dumps(first.summary, sort_keys=True, default=str) == json.dumps(again, sort_keys=True, default=str)
    assert first.summary["num_finished"] == 400 and first.summary["config"]["block_size"] == 64
    calls = []
    original = Scheduler.schedule

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    Scheduler.schedule = counted
    try:
        replay(trace, config)
    finally:
        Scheduler.schedule = original
    assert len(calls) < first.summary["num_steps"] / 2  # (most decode steps jumped, not scheduled one by one)


def test_the_schedulers_capped_count_is_the_decoders_sum(tmp_path):
    """Every stepped decode step's capped count is the sum over its decoders of min(context, top-k),
    with a top-k small enough that decoders cross it mid-replay."""
    from simkv.core.scheduler import Scheduler

    config = EngineConfig.from_flat(V32)
    sched = Scheduler(config, 20_000, detail=True)
    sched._sparse_cap = 300  # (a small top-k: the decoders cross it)
    sched._window_context = (1, 0, 300)
    for i in range(12):
        sched.add_request(make_request(i, 50 + 40 * i, 400))
    crossed = checked = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if out.decodes:
            assert out.decode_capped_context_tokens == sum(min(d.num_computed_tokens + 1, 300) for d in out.decodes)
            assert out.decode_context_tokens == sum(d.num_computed_tokens + 1 for d in out.decodes)
            crossed += any(d.num_computed_tokens + 1 > 300 for d in out.decodes)
            checked += 1
        sched.update_from_output(out)
    assert checked > 100 and crossed > 50


def test_sparse_replays_on_data_parallel_ranks_and_pd_pools(tmp_path):
    runner = CliRunner()
    for name, extra in (("dp", ["-dp", "8"]), ("pd", ["-tp", "8", "--prefill-replicas", "1", "--decode-replicas", "1"])):
        res = runner.invoke(main, ["replay", "traces/req400.parquet", "--model", "deepseek-v3.2", "--gpu", "H200",
                                   "--out", str(tmp_path / name)] + extra)
        assert res.exit_code == 0, res.output
        assert json.loads((tmp_path / name / "summary.json").read_text())["num_finished"] == 400


def test_mtp_drafts_with_sparse_attention():
    """DeepSeek-V3.2's MTP layer is a target-shaped layer with its own indexer: its latent and
    indexer key ride in every block (62 layers), its passes attend each request's top-k, and a
    verification chunk (1 + K tokens) is a decode, never a dense prefill."""
    mtp = {"speculative_method": "mtp", "num_speculative_tokens": 2}
    capacity = compute_capacity(EngineConfig.from_flat(V32 | mtp))
    assert capacity.block_bytes == 64 * 62 * (1152 + 132)
    sparse, dense = (Drafter(EngineConfig.from_flat(V | mtp)) for V in (V32, {**V32, "model": "deepseek-v3"}))
    requests = [make_request(i, 100_000, 10) for i in range(64)]
    for r in requests:
        r.num_output_tokens = 1
    step = make_step(chunks=[ScheduledChunk(r, r.num_tokens - 1, 3, True) for r in requests])
    step.num_spec_tokens_to_schedule = 2
    assert 0 < sparse.seconds(step) < 0.8 * dense.seconds(step)  # (a layer and the LM head: the rest is weights)
    target = RooflineCostModel(get_model_spec("deepseek-v3.2"), get_gpu_spec("H200"), 8, block_size=64,
                               num_speculative_tokens=2)
    verify = ScheduledChunk(make_request(0, 1500, 10), 1000, 3)
    prefill = ScheduledChunk(make_request(1, 900, 10), 0, 900)
    _, _, pairs, reads, _, _ = target.step_work(make_step([verify, prefill]))
    assert pairs == 900 * 901 // 2  # (the prefill dense, the verification down the sparse path)
    # the verification's queries gather their own top-k latents; the prefill reads its context once
    far = ScheduledChunk(make_request(2, 50_000, 10), 40_000, 3)
    _, _, _, far_reads, _, _ = target.step_work(make_step([far]))
    assert far_reads == pytest.approx(3 * 2048 * target.latent_read_share + 40_003 * target.indexer_read_share)
    assert reads == pytest.approx(capped_pairs(1000, 3, 2048) * target.latent_read_share
                                  + 1003 * target.indexer_read_share + 900)
    trace = read_trace(TRACES / "req400.parquet")
    runs = [replay(trace, EngineConfig.from_flat(V32 | mtp)).summary for _ in range(2)]
    for s in runs:
        s.pop("wall_time_s")
    assert json.dumps(runs[0], sort_keys=True, default=str) == json.dumps(runs[1], sort_keys=True, default=str)
    assert runs[0]["num_finished"] == 400 and runs[0]["speculative_decoding"]["num_accepted_tokens"] > 0


def test_the_tp_ranks_split_the_prefill_rows_past_a_threshold():
    """vLLM's indexer_tp_shard_min_rows: a step with at least that many prefill tokens (CUDA, TP
    > 1) has each rank score 1 / TP of the prefill rows and all-gather their top-k indices; below
    it (65,536 by default, more than a step's budget) every rank scores every row."""
    spec, gpu = get_model_spec("deepseek-v3.2"), get_gpu_spec("H200")
    default = RooflineCostModel(spec, gpu, 8, block_size=64)
    split = RooflineCostModel(spec, gpu, 8, block_size=64, indexer_tp_shard_min_rows=4096)
    step = make_step([ScheduledChunk(make_request(0, 40_000, 5), 30_000, 8192)])
    scored = 8192 * 30_000 + 8192 * 8193 // 2
    attended = capped_pairs(30_000, 8192, 2048)
    assert default.step_work(step)[4] == pytest.approx(attended + scored * default.indexer_pair_ratio)
    assert split.step_work(step)[4] == pytest.approx(attended + scored / 8 * split.indexer_pair_ratio)
    assert default.indexer_exchange_seconds(step) == 0
    exchange = split.indexer_exchange_seconds(step)
    assert exchange == pytest.approx(61 * (8192 * 2048 * 4 * 7 / 8 / (gpu.interconnect_gbs * 1e9) + 8e-6))
    assert split.execute(step) < default.execute(step)
    small = make_step([ScheduledChunk(make_request(1, 40_000, 5), 30_000, 2048)])
    assert split.indexer_exchange_seconds(small) == 0 and split.execute(small) == default.execute(small)
    one = RooflineCostModel(spec, gpu, 1, block_size=64, indexer_tp_shard_min_rows=1)
    assert one.indexer_exchange_seconds(step) == 0
    config = EngineConfig.from_flat(V32 | {"indexer_tp_shard_min_rows": 4096})
    assert config.attention.indexer_tp_shard_min_rows == 4096
    with pytest.raises(ConfigError, match="indexer_tp_shard_min_rows must be >= 1"):
        EngineConfig.from_flat(V32 | {"indexer_tp_shard_min_rows": 0})


# vLLM 0.33's backend choice for DeepSeek-V3.2's sparse attention (scripts/oracle_sparse_mla_kv.py: its
# platform's priorities, each backend's validate_configuration and _canonicalize_sparse_mla_kv_cache_dtype):
# fp8 on Hopper runs FLASHMLA_SPARSE, which stores fp8_ds_mla; on Blackwell FLASHINFER_MLA_SPARSE,
# plain fp8 latents, unless fp8_ds_mla or nvfp4_ds_mla is asked for by name (then FLASHMLA_SPARSE); and
# the blocks vLLM's planning code gives 40 GiB of KV cache in that layout (the latent and indexer specs
# in one group; None: not checked there)
@pytest.mark.parametrize("gpu, dtype, latent, blocks", [
    ("H200", "fp8", 656, 13961), ("H200", "fp8_ds_mla", 656, 13961), ("B200", "fp8", 576, 15538),
    ("H200", "fp8_e4m3", 576, 15538), ("B200", "fp8_e4m3", 576, 15538),  # (FlashInfer's sparse kernels: plain)
    ("B200", "fp8_ds_mla", 656, 13961), ("B200", "nvfp4_ds_mla", 352, 22730), ("B300", "nvfp4_ds_mla", 352, None),
    ("MI300X", "fp8", 576, None), ("B200", "auto", 1152, 8568), ("H200", "auto", 1152, 8568),
])
def test_the_latent_layout_is_the_sparse_backends(gpu, dtype, latent, blocks):
    config = EngineConfig.from_flat(V32 | {"gpu": gpu, "kv_cache_dtype": dtype})
    capacity = compute_capacity(config)
    assert capacity.kv_bytes_per_token == 61 * (latent + 132)  # (on each GPU: every one holds it whole)
    assert make_roofline(config).kv_bytes_per_token == 61 * (latent + 132)
    assert capacity.block_size == 64
    if blocks is not None:
        sized = EngineConfig.from_flat(V32 | {"gpu": gpu, "kv_cache_dtype": dtype, "kv_cache_memory_bytes": 40 * 2**30})
        assert compute_capacity(sized).num_gpu_blocks == blocks


@pytest.mark.parametrize("options, message", [
    ({"gpu": "H200", "kv_cache_dtype": "nvfp4_ds_mla"},
     "FLASHMLA_SPARSE only supports the nvfp4_ds_mla kv-cache dtype on SM100"),
    ({"gpu": "MI300X", "kv_cache_dtype": "fp8_ds_mla"}, r"ROCM_AITER_MLA_SPARSE\) takes auto, float16, bfloat16, fp8"),
    ({"model": "deepseek-v3", "kv_cache_dtype": "fp8_ds_mla"}, "deepseek-v3 has no sparse attention"),
    ({"model": "llama-3-8b", "tensor_parallel_size": 1, "kv_cache_dtype": "nvfp4_ds_mla"},
     "llama-3-8b has no sparse attention"),
    ({"gpu": "H200", "kv_cache_dtype": "fp8_e5m2"}, "no sparse MLA backend of vLLM's takes kv_cache_dtype fp8_e5m2"),
])
def test_the_sparse_layouts_by_name_are_refused_where_vllm_has_no_backend_for_them(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(V32 | options)


def test_capacity_names_the_latents_layout():
    for gpu, layout in (("H200", "fp8_ds_mla"), ("B200", "fp8")):
        res = CliRunner().invoke(main, ["capacity", "--model", "deepseek-v3.2", "-tp", "8", "--gpu", gpu,
                                        "--kv-cache-dtype", "fp8", "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["sparse_attention"]["latent_layout"] == layout


def test_consumer_blackwell_stores_flashmlas_layout_whatever_is_asked(tmp_path):
    """An SM120 card (a GPU file: simkv's catalogue has none) runs vLLM's FlashInfer SM120 sparse
    kernels, which store fp8_ds_mla for auto and every fp8 name and take no 16-bit cache."""
    gpu = tmp_path / "sm120.yaml"
    gpu.write_text("memory_gib: 192\nmem_bandwidth_gbs: 1600\nbf16_tflops: 500\nfp8_tflops: 1000\n"
                   "interconnect_gbs: 64\ncompute_capability: 12.0\n")
    for dtype in ("auto", "fp8", "fp8_e4m3"):
        config = EngineConfig.from_flat(V32 | {"gpu": str(gpu), "kv_cache_dtype": dtype})
        assert config.kv_element == "fp8_ds_mla" and compute_capacity(config).kv_bytes_per_token == 61 * (656 + 132)
    with pytest.raises(ConfigError, match="its SM120 kernels store fp8_ds_mla: use auto or fp8"):
        EngineConfig.from_flat(V32 | {"gpu": str(gpu), "kv_cache_dtype": "bfloat16"})
