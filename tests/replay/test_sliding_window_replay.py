"""Replays of models with sliding-window layers: capacity, cost, outputs, options and errors."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.backends.base import layer_window_counts, prefill_work, window_pairs_and_reads, windowed_prefill_work
from simkv.backends.factory import make_backend
from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig
from simkv.core.outputs import ScheduledChunk, SchedulerOutput
from simkv.replay.api import replay
from simkv.specs import get_model_spec
from simkv.traces.schema import trace_from_frame
from tests.core.helpers import decode_contexts, make_request


def _trace(n=40, seed=3, long=False):
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 5, n)),
                          "prompt_tokens": rng.integers(2000, 6000, n) if long else rng.integers(10, 900, n),
                          "output_tokens": rng.integers(1, 200, n)})
    return trace_from_frame(frame)


def _step(*chunks) -> SchedulerOutput:
    out = [ScheduledChunk(make_request(i, c + n + 1, 1), c, n) for i, (c, n) in enumerate(chunks)]
    return SchedulerOutput(step=0, chunks=out, num_decode_reqs=0, decode_context_tokens=0, decodes=None, preempted=[],
                           num_running=len(out), num_waiting=0, num_blocks_used=0, prefix_query_tokens=0,
                           prefix_hit_tokens=0)


@pytest.mark.parametrize("n, c, w", [(1, 0, 4), (5, 0, 4), (1, 100, 8), (30, 3, 8), (7, 20, 64), (100, 1000, 2)])
def test_window_pairs_and_reads_count_each_token(n, c, w):
    pairs = sum(min(p + 1, w) for p in range(c, c + n))
    keys = {k for p in range(c, c + n) for k in range(max(0, p - w + 1), p + 1)}
    assert window_pairs_and_reads(n, c, w) == (pairs, len(keys))


def test_windowed_work_averages_the_layers():
    """Half the layers slide (window 8): pairs and reads are the mean of the full and windowed
    counts; without windows the figures are prefill_work's."""
    out = _step((100, 1), (0, 20))
    full = prefill_work(out)
    assert windowed_prefill_work(out, layer_window_counts([0, 0]), 2) == full
    tokens, pairs, reads = windowed_prefill_work(out, layer_window_counts([8, 0]), 2)
    w_pairs = window_pairs_and_reads(1, 100, 8)[0] + window_pairs_and_reads(20, 0, 8)[0]
    w_reads = window_pairs_and_reads(1, 100, 8)[1] + window_pairs_and_reads(20, 0, 8)[1]
    assert (tokens, pairs, reads) == (21, (full[1] + w_pairs) / 2, (full[2] + w_reads) / 2)


def test_roofline_decode_reads_only_the_windows():
    """gemma-2-9b (half its layers slide over 4,096 tokens), batch of 64 decodes at 32k context:
    its windows make the step faster than the same model attending everything."""
    decodes = _step(*[(32_000, 1)] * 64)
    base = dict(model="gemma-2-9b", gpu="H100-SXM", num_gpu_blocks=1000, max_model_len=40_000)
    windowed = make_backend("roofline", EngineConfig.from_flat(base)).execute(decodes)
    full = make_backend("roofline", EngineConfig.from_flat(base | {"sliding_window": 0})).execute(decodes)
    assert windowed < 0.8 * full


def test_capacity_blocks_hold_a_group_of_layers():
    """gemma-3-27b: 62 layers, 16 KV heads x 128 x 2 bytes x K and V = 8,192 B per layer per token.
    The hybrid manager's blocks hold 10 layers (7 groups, 8 padding layers); disabled, all 62."""
    base = dict(model="gemma-3-27b", gpu="H100-SXM", max_model_len=32768)
    hybrid = compute_capacity(EngineConfig.from_flat(base))
    plain = compute_capacity(EngineConfig.from_flat(base | {"disable_hybrid_kv_cache_manager": True}))
    assert hybrid.block_bytes == 10 * 8192 * 16 and plain.block_bytes == 62 * 8192 * 16
    assert hybrid.num_gpu_blocks == hybrid.available_kv_bytes // hybrid.block_bytes
    assert plain.num_gpu_blocks == plain.available_kv_bytes // plain.block_bytes
    # vLLM's start-up figure: a 32k request holds 2,048 blocks in the full group and the window cap
    # ceil(min(1023 + 8192, 32768) / 16) + 1 = 577 in each of the 6 window groups
    assert hybrid.blocks_per_request == 2048 + 6 * 577
    assert hybrid.max_concurrency == pytest.approx(hybrid.num_gpu_blocks / (2048 + 6 * 577))
    assert plain.max_concurrency == pytest.approx(plain.num_gpu_blocks * 16 / 32768)
    assert hybrid.max_concurrency > 2 * plain.max_concurrency


def test_max_model_len_check_counts_the_groups():
    """131k tokens: the hybrid manager fits on one H100, the disabled one does not (vLLM's text)."""
    base = dict(model="gemma-3-27b", gpu="H100-SXM")
    compute_capacity(EngineConfig.from_flat(base))
    with pytest.raises(ConfigError, match=r"model's max seq len \(131072\).*estimated maximum model length is 45024"):
        compute_capacity(EngineConfig.from_flat(base | {"disable_hybrid_kv_cache_manager": True}))


def test_replay_outputs_and_determinism(tmp_path):
    base = dict(model="gemma-3-27b", gpu="H200", max_model_len=8192)
    first = replay(_trace(long=True), EngineConfig.from_flat(base))
    second = replay(_trace(long=True), EngineConfig.from_flat(base))
    groups = first.summary["kv_cache_groups"]
    assert groups["summary"] == "6 x sliding_window(1024) + 1 x full_attention" and groups["hybrid_kv_cache_manager"]
    assert groups["block_bytes"] == 10 * 8192 * 16  # 10 layers of gemma-3-27b's 8,192 B per token
    assert first.summary["num_finished"] == 40
    assert first.requests.equals(second.requests)
    assert {k: v for k, v in first.summary.items() if k != "wall_time_s"} == \
        {k: v for k, v in second.summary.items() if k != "wall_time_s"}
    assert first.summary["config"]["sliding_window"] is None  # the model's own
    assert first.summary["config"]["prefix_cache_retention_interval"] == 0


def test_hybrid_manager_holds_fewer_blocks_than_full_allocation():
    """The same long-prompt trace on the same number of token slots: under the hybrid manager
    the peak KV bytes in use are well below the disabled manager's (windows give blocks back)."""
    base = dict(model="gemma-3-27b", gpu="H200", max_model_len=8192)
    hybrid = replay(_trace(long=True), EngineConfig.from_flat(base), "unit")
    plain = replay(_trace(long=True), EngineConfig.from_flat(base | {"disable_hybrid_kv_cache_manager": True}), "unit")
    hybrid_bytes = hybrid.summary["peak_blocks_used"] * 10
    plain_bytes = plain.summary["peak_blocks_used"] * 62  # layers per block
    assert hybrid_bytes < 0.6 * plain_bytes


@pytest.mark.parametrize("options, message", [
    (dict(speculative_method="draft_model", spec_draft_model="llama-3.2-1b", num_speculative_tokens=2),
     "not modelled with speculative_method 'draft_model'"),
    (dict(preemption_mode="swap"), "not modelled with preemption_mode 'swap'"),
    (dict(prefix_cache_retention_interval=24), r"retention_interval \(24\) must be non-negative and a multiple of "
                                               r"scheduler_block_size \(16\)"),
    (dict(sliding_window=1), "sliding_window must be >= 2"),
])
def test_refused_combinations(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(dict(model="gemma-2-9b") | options)


def test_retention_needs_a_window_group():
    with pytest.raises(ConfigError, match="has no sliding-window or Mamba KV cache group"):
        EngineConfig.from_flat(dict(model="llama-3-8b", prefix_cache_retention_interval=32))
    EngineConfig.from_flat(dict(model="llama-3-8b", prefix_cache_retention_interval=None))  # (allowed, as in vLLM)


def test_cli(tmp_path):
    trace = tmp_path / "t.parquet"
    pd.DataFrame({"arrival_time_s": [0.0, 0.1, 0.2], "prompt_tokens": [3000, 2000, 50],
                  "output_tokens": [5, 5, 5]}).to_parquet(trace)
    runner = CliRunner()
    out = tmp_path / "out"
    res = runner.invoke(main, ["replay", str(trace), "--out", str(out), "--model", "gemma-2-9b",
                               "--prefix-cache-retention-interval", "none", "--quiet"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["prefix_cache_retention_interval"] is None
    assert summary["kv_cache_groups"]["summary"] == "1 x sliding_window(4096) + 1 x full_attention"
    res = runner.invoke(main, ["replay", str(trace), "--out", str(tmp_path / "o2"), "--model", "gemma-2-9b",
                               "--sliding-window", "0", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "kv_cache_groups" not in json.loads((tmp_path / "o2" / "summary.json").read_text())
    res = runner.invoke(main, ["replay", str(trace), "--model", "gemma-2-9b", "--backend", "gpu"])
    assert res.exit_code != 0 and "sliding-window layers: simulated only" in res.output
    res = runner.invoke(main, ["capacity", "--model", "gemma-3-27b", "--max-model-len", "32768", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["kv_cache_groups"]["layers_per_block"] == 10 and rep["block_bytes_per_gpu"] == 10 * 8192 * 16


def test_layer_windows_of_the_specs():
    assert get_model_spec("gemma-3-27b").layer_windows().count(0) == 10  # layers 5, 11, ..., 59
    assert get_model_spec("gemma-2-9b").layer_windows()[:2] == [4096, 0]
    assert get_model_spec("llama-3-8b").layer_windows(sliding_window=64) == [64] * 32


def test_parallel_sampling_fans_out_and_forks_are_refused_with_its_row():
    """vLLM v1's fan-out runs on a sliding-window model (checked step by step against vLLM:
    scripts/oracle_hybrid.py --parallel); v0's forks are refused, naming the row."""
    frame = pd.DataFrame({"arrival_time_s": [0.0, 0.1], "prompt_tokens": [30, 40], "output_tokens": [5, 5], "n": [1, 3]})
    config = dict(model="gemma-2-9b", max_model_len=4096)
    res = replay(trace_from_frame(frame), EngineConfig.from_flat(config))
    assert res.requests["output_tokens"].tolist() == [5, 15]
    # the two later members, admitted with the first, hit its prompt's full blocks but the last
    assert res.requests["prefix_hit_tokens"].tolist() == [0, 2 * 32]
    with pytest.raises(ValueError, match=r"row 1: n = 3 \(parallel sampling\) forked as vLLM v0 did is not modelled "
                                         r"for models with sliding-window layers \(gemma-2-9b\)"):
        replay(trace_from_frame(frame), EngineConfig.from_flat(config | {"parallel_sampling": "fork"}))


@pytest.mark.parametrize("model, num_gpu_blocks", [("gemma-2-9b", 700), ("gemma-3-27b", 2200)])
def test_parallel_sampling_with_decode_runs_on_sliding_window_models(model, num_gpu_blocks):
    """Fanned-out rows on models with sliding-window layers, under pressure (preemptions): the
    replay that jumps over decode runs equals the stepped one, every row completes with all its
    sequences."""
    from tests.core.helpers import assert_decode_runs_change_nothing

    rng = np.random.default_rng(8)
    n = 40
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 2, n)), "prompt_tokens": rng.integers(10, 2500, n),
                          "output_tokens": rng.integers(1, 300, n), "n": rng.choice([1, 1, 2, 4], n)})
    config = EngineConfig.from_flat(dict(model=model, max_model_len=4096, num_gpu_blocks=num_gpu_blocks,
                                         max_num_seqs=32))
    a = assert_decode_runs_change_nothing(trace_from_frame(frame), config)
    assert a.summary["num_finished"] == n and a.summary["num_preemptions"] > 0
    assert a.requests["output_tokens"].tolist() == (frame.output_tokens * frame.n).tolist()
    assert a.requests["prefix_hit_tokens"][frame.n > 1].sum() > 0


def test_ngram_speculation_on_a_sliding_window_model():
    """ngram drafts on gemma-2-9b: the replay runs, reports its drafts, and every request finishes."""
    config = EngineConfig.from_flat(dict(model="gemma-2-9b", gpu="H100-SXM", max_model_len=8192,
                                         speculative_method="ngram", num_speculative_tokens=3,
                                         spec_acceptance_rate=0.5))
    res = replay(_trace(), config)
    assert res.summary["num_finished"] == 40
    assert res.summary["speculative_decoding"]["num_draft_tokens"] > 0
    assert res.summary["kv_cache_groups"]["hybrid_kv_cache_manager"]


def test_eagle_layer_joins_the_full_attention_layers():
    """An EAGLE-3 head on a sliding-window model: its draft layer attends the whole context, so
    vLLM buckets it with the full-attention layers. gpt-oss-120b (18 window + 18 full layers)
    then has 18 + 19 layers: the group size becomes 19 (19 < 1.5 * 18), one block holds 19
    layers, and the window group carries one padding layer. gemma-3-27b (52 + 10) gets
    52 + 11: size 11, five window groups and one full (3 padding layers instead of 8)."""
    eagle = dict(speculative_method="eagle3", num_speculative_tokens=3)
    oss = EngineConfig.from_flat(dict(model="gpt-oss-120b", gpu="H100-SXM") | eagle).kv_cache_groups
    assert [(g.sliding_window, g.num_layers) for g in oss.groups] == [(128, 18), (0, 19)]
    assert oss.layers_per_block == 19 and oss.num_padding_layers == 1
    gemma = EngineConfig.from_flat(dict(model="gemma-3-27b", gpu="H200") | eagle).kv_cache_groups
    assert gemma.summary() == "5 x sliding_window(1024) + 1 x full_attention"
    assert (gemma.layers_per_block, gemma.num_padding_layers) == (11, 3)
    plain = EngineConfig.from_flat(dict(model="gemma-3-27b", gpu="H200")).kv_cache_groups
    assert (plain.layers_per_block, plain.num_padding_layers) == (10, 8)


def test_eagle_speculation_on_a_sliding_window_model():
    """EAGLE-3 on gpt-oss-120b: every request finishes with all its tokens, drafts are accepted,
    the pool's blocks hold 19 layers (the draft layer's KV) and fewer fit than without the head
    (its layer's weights and KV), and the median TPOT falls."""
    base = dict(model="gpt-oss-120b", gpu="H100-SXM", max_model_len=8192)
    eagle = base | dict(speculative_method="eagle3", num_speculative_tokens=3,
                        spec_position_acceptance_rates="0.8,0.6,0.45")
    plain, spec = (replay(_trace(), EngineConfig.from_flat(b)) for b in (base, eagle))
    assert spec.summary["num_finished"] == 40
    assert (spec.requests["output_tokens"] == plain.requests["output_tokens"]).all()
    assert spec.summary["speculative_decoding"]["num_accepted_tokens"] > 0
    assert spec.summary["kv_cache_groups"]["layers_per_block"] == 19
    assert spec.summary["num_gpu_blocks"] < plain.summary["num_gpu_blocks"]
    assert spec.summary["tpot_s"]["p50"] < 0.9 * plain.summary["tpot_s"]["p50"]  # (8.1 -> 6.6 ms here)
    # under async scheduling (vLLM's serving default for EAGLE) too: all tokens, and the host's
    # share of each step overlaps the device's, so the median TPOT falls further
    async_ = replay(_trace(), EngineConfig.from_flat(eagle | {"async_scheduling": True}))
    assert (async_.requests["output_tokens"] == plain.requests["output_tokens"]).all()
    assert async_.summary["speculative_decoding"]["num_accepted_tokens"] > 0
    assert async_.summary["tpot_s"]["p50"] < spec.summary["tpot_s"]["p50"]


def test_pd_disaggregation_pulls_only_the_windows():
    """P/D on gpt-oss-120b (1 prefill + 1 decode replica): every request finishes, and a pull
    carries each full-attention group's prompt blocks but a window group's only inside its
    128-token window, so the link carries well under what the disabled hybrid manager (every
    layer's prompt blocks) pulls: prompt tokens x 36 KiB (18 full layers) plus about ten
    window blocks per pull, against prompt tokens x 72 KiB."""
    from simkv.replay.disaggregated import DisaggregationSpec

    base = dict(model="gpt-oss-120b", gpu="H100-SXM", max_model_len=8192)
    hybrid, plain = (replay(_trace(long=True), EngineConfig.from_flat(b), disaggregation=DisaggregationSpec(1, 1))
                     for b in (base, base | {"disable_hybrid_kv_cache_manager": True}))
    for res in (hybrid, plain):
        assert res.summary["num_finished"] == 40
    prompt = int(_trace(long=True).prompt_tokens.sum())
    per_layer_token = 2 * 8 * 64 * 2  # K and V, 8 KV heads of 64, bf16
    pulled = hybrid.summary["disaggregation"]["kv_transfer"]["pulled_bytes"]
    assert plain.summary["disaggregation"]["kv_transfer"]["pulled_bytes"] >= prompt * 36 * per_layer_token
    assert prompt * 18 * per_layer_token <= pulled < prompt * 18 * per_layer_token + 40 * 10 * 16 * 18 * per_layer_token
    # EAGLE-3 too (vLLM's eagle block drop under the connector, in the full-attention group)
    eagle = replay(_trace(long=True), EngineConfig.from_flat(base | dict(speculative_method="eagle3",
                                                                          num_speculative_tokens=2)),
                   disaggregation=DisaggregationSpec(1, 1))
    assert eagle.summary["num_finished"] == 40
    assert eagle.summary["speculative_decoding"]["num_accepted_tokens"] > 0


def test_fragmentation_counts_every_group():
    """One request, prompt 100, 10 outputs, block 16, tiny-llama with a window of 32 on one of its
    two layers (groups [32, full]). At its end it has 109 computed tokens: the full group holds
    them in 7 blocks (3 slots empty); the window group gave back the blocks below
    109 - 1 - 32 + 1 = 77, i.e. 4 of them, and holds tokens 64-108 (45 slots, 3 empty)."""
    from simkv.traces.schema import trace_from_frame

    frame = pd.DataFrame({"arrival_time_s": [0.0], "prompt_tokens": [100], "output_tokens": [10]})
    config = EngineConfig.from_flat(dict(model="tiny-llama", sliding_window=32, full_attention_interval=2,
                                         num_gpu_blocks=64, max_model_len=256))
    res = replay(trace_from_frame(frame), config, "unit")
    assert res.summary["internal_fragmentation_pct"] == pytest.approx(100 * (3 + 3) / (109 + 45))


def _identical(a, b):
    pd.testing.assert_frame_equal(a.requests, b.requests)
    for name, values in a.steps.items():
        assert np.array_equal(values, b.steps[name]), name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), window=st.sampled_from([2, 5, 16, 40, 300]), interval=st.sampled_from([0, 2, 6]),
       block_size=st.sampled_from([4, 16]), blocks=st.sampled_from([0, 40, 400]), caching=st.booleans(),
       retention=st.sampled_from([0, None]), hybrid=st.booleans(), async_=st.booleans())
def test_decode_runs_change_nothing(seed, window, interval, block_size, blocks, caching, retention, hybrid, async_):
    """Steady decoders of sliding-window models (window releases on the boundary heap, the context
    counted per layer): jumping over decode runs gives the very steps and requests that stepping
    one by one gives, small pools (preemptions, requests waiting for a release) and async
    scheduling (releases on the processed tokens) included."""
    rng = np.random.default_rng(seed)
    n = 40
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 2, n)), "prompt_tokens": rng.integers(1, 700, n),
                          "output_tokens": rng.integers(1, 300, n)})
    opts = dict(model="gemma-2-9b", gpu="H100-SXM", sliding_window=window, full_attention_interval=interval,
                block_size=block_size, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512,
                enable_prefix_caching=caching, disable_hybrid_kv_cache_manager=not hybrid, async_scheduling=async_)
    if hybrid:
        opts["prefix_cache_retention_interval"] = retention
    config = EngineConfig.from_flat(opts)
    from simkv.capacity import group_blocks_per_request

    if blocks:
        config = EngineConfig.from_flat(opts | {"num_gpu_blocks": group_blocks_per_request(config, 1024, startup=True) + blocks})
    trace = trace_from_frame(frame)
    a = replay(trace, config, "roofline")
    b = replay(trace, config, "roofline", use_decode_runs=False)
    _identical(a, b)
    assert a.summary["num_finished"] == n


def test_windowed_decode_context_is_counted_per_layer():
    """A decode step's context under sliding-window layers: full-attention layers attend every
    token, window layers at most the window, summed over the layers (the roofline divides by the
    layer count); one token before, at and after the window."""
    config = EngineConfig.from_flat(dict(model="gemma-2-9b", sliding_window=8, block_size=4, max_model_len=64,
                                         num_gpu_blocks=200))
    layers = config.layer_windows
    full, sliding = layers.count(0), len(layers) - layers.count(0)
    contexts = decode_contexts(config, make_request(0, 5, 10))
    # decodes at 5..13 cached tokens attend 6..14 tokens; the window layers 6, 7, 8, 8, ...
    assert contexts == [full * (c + 1) + sliding * min(c + 1, 8) for c in range(5, 14)]
    step = SchedulerOutput(step=0, chunks=[], num_decode_reqs=1, decode_context_tokens=contexts[-1], decodes=None,
                           preempted=[], num_running=1, num_waiting=0, num_blocks_used=0, prefix_query_tokens=0,
                           prefix_hit_tokens=0)
    as_chunk = _step((13, 1))
    backend = make_backend("roofline", config)
    assert backend.execute(step) == pytest.approx(backend.execute(as_chunk), rel=1e-12)


def test_calibrated_cost_models_refuse_sliding_window_layers(tmp_path):
    """A calibration's features count every layer attending the whole context: replaying a model
    with sliding-window layers through one is refused, naming the option."""
    config = EngineConfig.from_flat(dict(model="tiny-llama", sliding_window=8, max_model_len=256))
    with pytest.raises(ValueError, match=r"--cost-model .*calib\.json: .*sliding-window layers"):
        make_backend(str(tmp_path / "calib.json"), config)


def test_async_scheduling_admission_cap_counts_two_batches():
    """vLLM frees window blocks on processed tokens, so under async scheduling a sliding-window
    group's cap is ceil(min(1023 + 2 x 8192, 32768) / 16) + 1 = 1,089 blocks (577 synchronously):
    vLLM's start-up concurrency for gemma-3-27b at 32k drops; `simkv capacity` takes the flag."""
    base = dict(model="gemma-3-27b", gpu="H200", max_model_len=32768)
    sync = compute_capacity(EngineConfig.from_flat(base))
    async_ = compute_capacity(EngineConfig.from_flat(base | {"async_scheduling": True}))
    assert async_.num_gpu_blocks == sync.num_gpu_blocks
    assert (sync.blocks_per_request, async_.blocks_per_request) == (2048 + 6 * 577, 2048 + 6 * 1089)
    out = CliRunner().invoke(main, ["capacity", "--model", "gemma-3-27b", "--gpu", "H200", "--max-model-len", "32768",
                                    "--async-scheduling", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["max_concurrency"] == pytest.approx(async_.num_gpu_blocks / (2048 + 6 * 1089))
