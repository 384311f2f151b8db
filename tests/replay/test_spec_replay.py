"""Replays under speculative decoding: outputs, timing of tokens, the drafter's cost, errors."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.replay.api import replay
from simkv.traces.schema import trace_from_frame

SPEC = dict(speculative_method="eagle", num_speculative_tokens=3, spec_acceptance_rate=0.7)


def _trace(rows, **extra):
    frame = pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens"])
    for key, values in extra.items():
        frame[key] = values
    return trace_from_frame(frame)


def _config(**options):
    return EngineConfig.from_flat(dict(num_gpu_blocks=2000, max_model_len=4096) | options)


def test_linear_steps_and_token_times():
    """unit cost (every step 1 s, no drafter time). One request, prompt 10, 6 outputs, every
    draft accepted: steps of 10, 4 and 4 tokens (the last keeps 1 token of 4)."""
    trace = _trace([(0.0, 10, 6)])
    res = replay(trace, _config(**(SPEC | {"spec_acceptance_rate": 1.0})), "unit")
    steps = res.steps
    assert steps["duration_s"].tolist() == [1.0, 1.0, 1.0]
    assert steps["num_prefill_tokens"].tolist() == [10, 0, 0]
    assert steps["num_draft_tokens"].tolist() == [0, 3, 3]
    assert steps["num_accepted_tokens"].tolist() == [0, 3, 3]
    assert steps["num_decode_tokens"].tolist() == [0, 1, 1]  # one token gap closed per verifying step
    row = res.requests.iloc[0]
    assert (row["ttft_s"], row["e2e_s"]) == (1.0, 3.0)
    assert row["mean_itl_s"] == pytest.approx(2 / 5)  # TPOT: 5 tokens after the first in 2 s
    assert (row["num_draft_tokens"], row["num_accepted_tokens"]) == (6, 6)
    assert res.summary["itl_s"]["p50"] == 1.0  # a gap per step, however many tokens it brings
    spec = res.summary["speculative_decoding"]
    assert spec["num_drafts"] == 2 and spec["mean_acceptance_length"] == pytest.approx(4.0)


def test_speculation_shortens_decoding_and_is_deterministic():
    rows = [(0.05 * i, 200 + 13 * i, 60 + 7 * (i % 5)) for i in range(40)]
    trace = _trace(rows)
    plain = replay(trace, _config(), "roofline")
    spec = replay(trace, _config(**SPEC), "roofline")
    again = replay(trace, _config(**SPEC), "roofline")
    assert spec.summary["tpot_s"]["mean"] < 0.7 * plain.summary["tpot_s"]["mean"]
    for key in ("num_draft_tokens", "num_accepted_tokens"):
        assert spec.requests[key].sum() == spec.summary["speculative_decoding"][key] == spec.steps[key].sum()
    assert spec.requests.equals(again.requests)
    assert all(np.array_equal(spec.steps[c], again.steps[c]) for c in spec.steps)
    assert spec.requests["output_tokens"].tolist() == plain.requests["output_tokens"].tolist()
    other = replay(trace, _config(**SPEC, spec_seed=5), "roofline")
    assert other.summary["speculative_decoding"]["num_accepted_tokens"] != \
        spec.summary["speculative_decoding"]["num_accepted_tokens"]
    assert 0 < spec.summary["speculative_decoding"]["drafter_time_share"] < 0.5


def test_rejected_drafts_only_cost_time():
    """Acceptance 0: every step still verifies K drafts (and runs the drafter) but keeps one
    token, so decoding is slower than without speculation."""
    trace = _trace([(0.0, 100, 50), (0.0, 120, 40)])
    plain = replay(trace, _config(), "roofline")
    spec = replay(trace, _config(**(SPEC | {"spec_acceptance_rate": 0.0})), "roofline")
    assert spec.summary["num_steps"] == plain.summary["num_steps"]
    assert spec.summary["speculative_decoding"]["num_accepted_tokens"] == 0
    assert spec.summary["tpot_s"]["mean"] > plain.summary["tpot_s"]["mean"]


def _decode_chunks_step(k: int, contexts: list[int]):
    """A step of verify chunks: each request has sampled 5 tokens and has `contexts[i]` tokens
    computed, the last sampled one and k drafts to verify."""
    from simkv.core.outputs import ScheduledChunk, SchedulerOutput
    from tests.core.helpers import make_request

    chunks = []
    for i, computed in enumerate(contexts):
        request = make_request(i, computed - 4, 100)
        request.num_output_tokens = 5
        chunks.append(ScheduledChunk(request, computed, 1 + k, True, num_spec_tokens=k))
    return SchedulerOutput(step=0, chunks=chunks, num_decode_reqs=0, decode_context_tokens=0, decodes=None,
                           preempted=[], num_running=len(chunks), num_waiting=0, num_blocks_used=0,
                           prefix_query_tokens=0, prefix_hit_tokens=0, num_verify_tokens=len(chunks) * (1 + k),
                           num_draft_tokens=len(chunks) * k, num_spec_tokens_to_schedule=k)


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_parallel_drafting_is_one_pass(method):
    """vLLM's parallel_drafting: the drafts come from the first pass alone, which has K - 1 (an
    EAGLE head) or K (a draft model) more queries per request, each attending the request's
    tokens and the extra queries before it; drafting in turn, a draft model's first pass has one
    more query per request."""
    from simkv.backends.drafting import Drafter

    k, contexts = 5, [300, 1200, 40]
    options = dict(speculative_method=method, num_speculative_tokens=k)
    if method == "draft_model":
        options["spec_draft_model"] = "llama-3.2-1b"
    out = _decode_chunks_step(k, contexts)
    sequential, parallel = Drafter(_config(**options)), Drafter(_config(**options, spec_parallel_drafting=True))
    net = parallel.network
    ends = [c + 1 + k for c in contexts]  # (the tokens each request has once its chunk is in)
    step_tokens = len(contexts) * (1 + k)
    step_pairs = sum((1 + k) * c + (1 + k) * (2 + k) // 2 for c in contexts)
    step_read = sum(c + 1 + k for c in contexts)

    def first(m):  # the first pass with m extra queries per request
        pairs = step_pairs + sum(m * e + m * (m + 1) // 2 for e in ends)
        return net._time(step_tokens + m * len(contexts), len(contexts), pairs, step_read, max)

    m = k - 1 if method == "eagle3" else k
    assert parallel.seconds(out) == first(m)
    later = net.decode_pass_seconds(len(contexts), sum(ends))
    assert sequential.seconds(out) == pytest.approx(first(int(method == "draft_model")) + (k - 1) * later, rel=1e-12)
    assert parallel.seconds(out) < 0.5 * sequential.seconds(out)


def test_dflash_drafts_in_one_pass_over_its_context():
    """dflash: the step's tokens' tapped hidden states are projected into the drafter's K and V
    (fc: 5 x 4,096 x 4,096 parameters whole, each layer's K and V projection), then one pass of
    K + 1 queries per sampling request through 5 target-shaped layers, attending the request's
    tokens and each other, with logits for K of them."""
    from simkv.backends.drafting import Drafter

    k, contexts = 7, [300, 1200, 40]
    drafter = Drafter(_config(speculative_method="dflash", num_speculative_tokens=k))
    net = drafter.network
    assert net.model.num_layers == 5
    out = _decode_chunks_step(k, contexts)
    ends = [c + 1 + k for c in contexts]
    q, h = k + 1, 4096
    query = net._time(3 * q, 3 * k, q * sum(ends) + 3 * q * q, sum(ends), max)
    fc, kv_proj = 5 * h * h, 5 * h * 2 * 8 * 128  # (llama-3-8b: 8 KV heads of 128)
    tokens = 3 * (1 + k)
    kv_bytes = 5 * 2 * 8 * 128 * 2  # (the drafter's K and V of a token, 5 layers, bf16)
    context = max(2.0 * (fc + kv_proj) * tokens / net.flop_rate,
                  (2.0 * (fc + kv_proj) + (2.0 * 5 * h + kv_bytes) * tokens) / net.byte_rate)
    assert drafter.seconds(out) == pytest.approx(query + context, rel=1e-12)
    assert context < 0.5 * query


def test_dflash_takes_its_layers_from_the_kv_cache():
    """dflash's five layers hold KV for every token, and their weights and the projection of the
    target's hidden states come off the KV cache (the embedding and LM head are the target's)."""
    base = compute_capacity(EngineConfig.from_flat({})).num_gpu_blocks
    dflash = compute_capacity(EngineConfig.from_flat(dict(speculative_method="dflash", num_speculative_tokens=7)))
    three = compute_capacity(EngineConfig.from_flat(dict(speculative_method="dflash", num_speculative_tokens=7,
                                                         spec_draft_layers=3)))
    assert dflash.num_gpu_blocks < three.num_gpu_blocks < base
    # 32 target layers + 5 draft layers of KV per token; weights 5 layers and fc (5 x 4096^2, bf16) fewer
    layer_bytes = (4 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336) * 2
    free_base = base * 32 * 2 * 1024 * 2 * 16
    free = free_base - 5 * layer_bytes - 2 * 5 * 4096 * 4096
    assert dflash.num_gpu_blocks == pytest.approx(free / (37 * 2 * 1024 * 2 * 16), rel=0.01)


def test_dflash_warns_when_its_batch_caps_the_running_requests(tmp_path):
    """vLLM lowers max_num_active_seqs when max_num_batched_tokens cannot hold K + 1 query tokens
    for every request; the replay says so."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n" + "".join(f"{i * 0.01},50,20\n" for i in range(20)))
    result = CliRunner().invoke(main, ["replay", str(trace), "--out", str(tmp_path / "out"), "--speculative-method",
                                       "dflash", "--num-speculative-tokens", "15", "--max-num-batched-tokens", "256",
                                       "--quiet"])
    assert result.exit_code == 0, result.output
    assert "dflash's draft pass needs 16 query tokens per request" in result.output
    assert "at most 16 requests run at once" in result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["peak_running"] <= 16


def test_parallel_drafting_shortens_steps():
    """The same trace and acceptances: drafting in parallel takes a smaller share of each step
    (one draft pass instead of K), so tokens come faster; the tokens kept are the same."""
    rows = [(0.05 * i, 200 + 13 * i, 60 + 7 * (i % 5)) for i in range(40)]
    trace = _trace(rows)
    options = dict(speculative_method="eagle3", num_speculative_tokens=5, spec_acceptance_rate=0.6)
    turn = replay(trace, _config(**options), "roofline")
    parallel = replay(trace, _config(**options, spec_parallel_drafting=True), "roofline")
    a, b = turn.summary["speculative_decoding"], parallel.summary["speculative_decoding"]
    assert b["drafter_time_share"] < 0.5 * a["drafter_time_share"]
    assert parallel.summary["tpot_s"]["mean"] < turn.summary["tpot_s"]["mean"]
    assert parallel.requests["output_tokens"].tolist() == turn.requests["output_tokens"].tolist()
    assert parallel.summary["cost_model"]["drafter"]["parallel_drafting"] is True


def test_a_prompt_that_never_fits_its_drafting_slots_is_named():
    """Without chunked prefill a prompt must fit max_num_batched_tokens with its drafting slots:
    vLLM waits forever for a 2,046-token prompt beside P-EAGLE's 4 slots (K = 5) in 2,048; the
    replay stops and says why (the same prompt runs when drafting in turn)."""
    from simkv.replay.engine import ReplayError

    trace = _trace([(0.0, 100, 5), (0.1, 2046, 5)])
    options = dict(speculative_method="eagle3", num_speculative_tokens=5, enable_chunked_prefill=False,
                   max_num_batched_tokens=2048, max_model_len=2048)
    assert (replay(trace, _config(**options)).requests["status"] == "finished").all()
    with pytest.raises(ReplayError, match="its 2,046 tokens and 4 drafting slots never fit max_num_batched_tokens"):
        replay(trace, _config(**options, spec_parallel_drafting=True))


def test_draft_networks_take_kv_memory():
    base = compute_capacity(EngineConfig.from_flat({})).num_gpu_blocks
    eagle = compute_capacity(EngineConfig.from_flat(SPEC)).num_gpu_blocks
    draft = compute_capacity(EngineConfig.from_flat(dict(speculative_method="draft_model", num_speculative_tokens=3,
                                                         spec_draft_model="llama-3.2-1b"))).num_gpu_blocks
    ngram = compute_capacity(EngineConfig.from_flat(dict(speculative_method="ngram", num_speculative_tokens=3)))
    assert ngram.num_gpu_blocks == base
    assert draft < eagle < base
    # eagle: one more layer of KV per token (33 instead of 32) and one layer of weights
    assert eagle == pytest.approx(base * 32 / 33, rel=0.01)


def test_cli(tmp_path):
    runner = CliRunner()
    out = tmp_path / "o"
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(out), "--quiet",
                             "--speculative-method", "ngram", "--num-speculative-tokens", "4",
                             "--spec-position-acceptance-rates", "0.6,0.4,0.25,0.1"])
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "summary.json").read_text())
    spec = summary["speculative_decoding"]
    assert summary["config"]["speculative_method"] == "ngram"
    assert spec["per_position_acceptance_rate"] == pytest.approx([0.6, 0.4, 0.25, 0.1], abs=0.03)
    steps = pd.read_parquet(out / "steps.parquet")
    assert steps["num_accepted_tokens"].sum() == spec["num_accepted_tokens"]
    assert "ngram, K=4" in (out / "report.html").read_text()
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(tmp_path / "x"), "--quiet",
                             "--speculative-method", "ngram", "--num-speculative-tokens", "2", "--async-scheduling",
                             "--model-runner", "v1"])
    assert r.exit_code != 0 and "not supported by the V1 model runner with ngram-based" in r.output
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(tmp_path / "v2"), "--quiet",
                             "--speculative-method", "ngram", "--num-speculative-tokens", "2", "--async-scheduling"])
    assert r.exit_code == 0, r.output  # (vLLM's default V2 runner drafts n-grams on the device)
    v2 = json.loads((tmp_path / "v2" / "summary.json").read_text())["speculative_decoding"]
    assert v2["model_runner"] == "v2" and v2["num_drafts"] > 0
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(tmp_path / "y"), "--quiet",
                             "--speculative-method", "eagle", "--num-speculative-tokens", "2",
                             "--prefill-replicas", "1", "--decode-replicas", "1", "--decode-set", "num_speculative_tokens=3"])
    assert r.exit_code != 0 and "the pools' num_speculative_tokens differ (2 and 3)" in r.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_disaggregated_pools_speculate():
    """P/D with EAGLE on both pools: every pulled request resumes with a padded 1 + K chunk (its
    placeholders verified, none accepted), the decode pool verifies the drafts, and the pulls
    carry the draft layer's KV too (33 layers of 32 + 1)."""
    from simkv.replay.disaggregated import DisaggregationSpec

    rows = [(0.05 * i, 300 + 7 * i, 20 + i % 9) for i in range(30)]
    plain = replay(_trace(rows), _config(), "roofline", disaggregation=DisaggregationSpec(1, 1))
    res = replay(_trace(rows), _config(**SPEC), "roofline", disaggregation=DisaggregationSpec(1, 1))
    spec = res.summary["speculative_decoding"]
    assert spec["num_padded"] == 30 and spec["num_accepted_tokens"] > 0
    assert res.summary["tpot_s"]["mean"] < plain.summary["tpot_s"]["mean"]
    moved = res.summary["disaggregation"]["kv_transfer"]["pulled_bytes"]
    assert moved == pytest.approx(plain.summary["disaggregation"]["kv_transfer"]["pulled_bytes"] * 33 / 32)


def test_disaggregated_pull_that_can_never_fit_is_refused():
    from simkv.replay.disaggregated import DisaggregationSpec

    config = EngineConfig.from_flat(dict(num_gpu_blocks=33, block_size=16, max_model_len=512, **SPEC))
    with pytest.raises(Exception, match="would never be admitted"):
        replay(_trace([(0.0, 100, 5)]), config, "roofline", disaggregation=DisaggregationSpec(1, 1))


def test_fleet_sums_its_replicas():
    rows = [(0.02 * i, 100 + i, 30) for i in range(30)]
    res = replay(_trace(rows), _config(**SPEC), "roofline", fleet=__import__("simkv.replay.api", fromlist=["FleetSpec"])
                 .FleetSpec(2, "round_robin"))
    spec = res.summary["speculative_decoding"]
    assert spec["num_accepted_tokens"] == int(res.requests["num_accepted_tokens"].sum()) > 0


def test_goodput_grid_may_give_the_speculation_length(tmp_path):
    """The base options are checked with the grid's first cell: --speculative-method alone is
    complete once --grid gives num_speculative_tokens (the missing trace is the only error)."""
    runner = CliRunner()
    args = ["goodput", str(tmp_path / "missing.parquet"), "--goodput", "tpot:50", "--speculative-method", "eagle"]
    r = runner.invoke(main, args + ["--grid", "num_speculative_tokens=2,4"])
    assert r.exit_code != 0 and "missing.parquet" in r.output and "num_speculative_tokens" not in r.output
    r = runner.invoke(main, args)
    assert r.exit_code != 0 and "num_speculative_tokens must be >= 1" in r.output


def test_capacity_counts_the_draft_network():
    runner = CliRunner()
    base = json.loads(runner.invoke(main, ["capacity", "--json"]).output)
    r = runner.invoke(main, ["capacity", "--json", "--speculative-method", "eagle3", "--num-speculative-tokens", "3"])
    eagle = json.loads(r.output)
    assert eagle["draft_network"] == "llama-3-8b (1 draft layer)"
    assert eagle["kv_bytes_per_token"] == base["kv_bytes_per_token"] * 33 // 32
    assert eagle["num_gpu_blocks"] == compute_capacity(EngineConfig.from_flat(SPEC)).num_gpu_blocks < base["num_gpu_blocks"]


def test_async_scheduling_with_eagle(tmp_path):
    """EAGLE-3 under async scheduling (vLLM 0.33's serving default for it): every request gets all
    its tokens, the steps account for every accepted draft, and the host's share of each step
    (roofline) overlaps the device's, so inter-token latency drops; some steps are scheduled for
    requests whose step in flight turns out to finish them, so there are more steps."""
    runner = CliRunner()
    summaries = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        args = ["replay", "traces/req400.parquet", "--out", str(out), "--quiet", "--speculative-method", "eagle3",
                "--num-speculative-tokens", "3", "--spec-position-acceptance-rates", "0.8,0.6,0.45"]
        r = runner.invoke(main, args + (["--async-scheduling"] if mode == "async" else []))
        assert r.exit_code == 0, r.output
        summaries[mode] = summary = json.loads((out / "summary.json").read_text())
        requests = pd.read_parquet(out / "requests.parquet").set_index("request_id")
        trace = pd.read_parquet("traces/req400.parquet").set_index("request_id")
        assert (requests["status"] == "finished").all()
        assert (requests["output_tokens"] == trace.loc[requests.index, "output_tokens"]).all()
        steps = pd.read_parquet(out / "steps.parquet")
        assert steps["num_accepted_tokens"].sum() == summary["speculative_decoding"]["num_accepted_tokens"]
    sync, async_ = summaries["sync"], summaries["async"]
    assert async_["itl_s"]["p50"] < 0.95 * sync["itl_s"]["p50"]
    assert async_["num_steps"] > sync["num_steps"]


def test_parallel_sampling_fans_out_under_speculative_decoding():
    """A row for n sequences is n requests (vLLM v1), each drafting and verifying on its own
    (checked step by step against vLLM: scripts/oracle_spec.py --parallel): the row reports all
    its members' tokens, drafts, accepted drafts and prefix hits; v0's forks are refused."""
    rows = [(0.0, 70, 40), (0.5, 100, 30), (0.5, 40, 50)]
    trace = _trace(rows, n=[1, 4, 2])
    res = replay(trace, _config(**SPEC))
    req, steps = res.requests, res.steps
    assert req["output_tokens"].tolist() == [40, 4 * 30, 2 * 50]
    assert req["num_accepted_tokens"].sum() == steps["num_accepted_tokens"].sum() > 0
    assert req["num_draft_tokens"].sum() == steps["num_draft_tokens"].sum()
    assert req["prefix_hit_tokens"].sum() == res.summary["prefix_cache_hits_tokens"] > 0
    # EAGLE keys a block with the token after it: row 1's members (100 tokens, blocks of 16) share
    # 6 blocks, the last of which is followed by a prompt token
    assert req["prefix_hit_tokens"].tolist()[1] == 3 * 96
    with pytest.raises(ValueError, match=r"row 1: n = 4 \(parallel sampling\) forked as vLLM v0 did is not "
                                         r"modelled with speculative decoding"):
        replay(trace, _config(**SPEC, parallel_sampling="fork"))


def test_multi_module_mtp_on_data_parallel_ranks():
    """Three MTP modules on two DP ranks (deepseek-v3, TP 8 on H200s): every module passes over its
    rank's whole step in lockstep, so the drafter's time exceeds one module's (whose later passes
    take a token per request) while the steps scheduled stay the same at equal acceptance."""
    trace = _trace([(0.05 * i, 300 + 40 * i, 30) for i in range(12)])
    runs = {}
    for modules in (1, 3):
        config = EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", tensor_parallel_size=8,
                                             data_parallel_size=2, speculative_method="mtp", num_speculative_tokens=3,
                                             spec_mtp_modules=modules, num_gpu_blocks=2000, max_model_len=4096))
        runs[modules] = replay(trace, config).summary
    one, three = runs[1]["speculative_decoding"], runs[3]["speculative_decoding"]
    assert three["drafter_time_s"] > one["drafter_time_s"] > 0
    assert three["num_draft_tokens"] == one["num_draft_tokens"]
    assert runs[3]["cost_model"]["drafter"]["multi_module_mtp"]
    assert "multi_module_mtp" not in runs[1]["cost_model"]["drafter"]
