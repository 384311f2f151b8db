"""Data-parallel attention for a mixture of experts (vLLM's --data-parallel-size): memory per GPU,
the lockstep ranks' steps, the roofline's share of the experts, refusals."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.backends.roofline import RooflineCostModel
from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig
from simkv.core.outputs import ScheduledChunk, SchedulerOutput
from simkv.replay.api import FleetSpec, replay
from simkv.specs import get_gpu_spec, get_model_spec
from simkv.traces.schema import read_trace
from tests.core.helpers import make_request

DP8 = dict(model="deepseek-v3", gpu="H200", data_parallel_size=8)


def test_ranks_replicate_attention_and_split_the_experts():
    """Under DP 8 (TP 1) every GPU holds the attention, dense layers, shared experts and embeddings
    whole and an eighth of the routed experts; each rank has its own pool, so the KV cache tokens
    of all ranks are 8 times one rank's (DeepSeek-V3 on 8 H200s: 5.4 times TP 8's)."""
    spec = get_model_spec("deepseek-v3")
    routed = spec.routed_expert_bytes
    assert spec.weight_bytes_per_gpu(1, 8) == pytest.approx(spec.weight_bytes - routed + routed / 8)
    assert spec.weight_bytes_per_gpu(8) == spec.weight_bytes / 8
    dp, tp = (compute_capacity(EngineConfig.from_flat(o)) for o in (DP8, dict(DP8, data_parallel_size=1,
                                                                             tensor_parallel_size=8)))
    assert dp.block_bytes == tp.block_bytes  # (the latent: whole on every GPU either way)
    assert 8 * dp.kv_cache_tokens / tp.kv_cache_tokens == pytest.approx(5.44, abs=0.01)
    res = CliRunner().invoke(main, ["capacity", "--model", "deepseek-v3", "--gpu", "H200", "-dp", "8", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["data_parallel_size"] == 8 and rep["kv_cache_tokens_all_ranks"] == 8 * dp.kv_cache_tokens
    assert rep["weight_bytes_per_gpu"] == int(spec.weight_bytes_per_gpu(1, 8))


def test_capacity_lays_a_model_out_every_way():
    """`simkv capacity --layouts 8`: engines of TP 1, 2, 4, 8, pipelines of them and, for a mixture of experts, data-
    parallel ranks of each TP below 8; each row as `simkv capacity` with that TP and DP gives it,
    times the engines or ranks; layouts whose weights do not fit say so."""
    res = CliRunner().invoke(main, ["capacity", "--model", "deepseek-v3", "--gpu", "H200", "--layouts", "8", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["layout"]: r for r in json.loads(res.output)["layouts"]}
    plain = [k for k in rows if "PP" not in k and "PCP" not in k]
    assert plain == ["8 x TP 1", "DP 8 x TP 1", "4 x TP 2", "DP 4 x TP 2", "2 x TP 4",
                     "DP 2 x TP 4", "1 x TP 8"]
    assert {"1 x TP 4 x PP 2", "1 x TP 1 x PP 8"} <= set(rows)  # (and pipelines: test_pipeline_parallel.py)
    assert "1 x TP 4 x PCP 2" in rows  # (and PCP copies: test_prefill_context_parallel.py)
    assert not rows["8 x TP 1"]["fits"] and not rows["2 x TP 4"]["fits"]
    for name, tp, dp in (("DP 8 x TP 1", 1, 8), ("DP 2 x TP 4", 4, 2), ("1 x TP 8", 8, 1)):
        cap = compute_capacity(EngineConfig.from_flat(dict(DP8, tensor_parallel_size=tp, data_parallel_size=dp)))
        assert rows[name]["kv_cache_tokens_all"] == cap.kv_cache_tokens * (8 // tp)
    dense = CliRunner().invoke(main, ["capacity", "--model", "qwen2.5-7b", "--layouts", "4"])
    assert dense.exit_code == 0 and "4 x TP 1" in dense.output and "DP" not in dense.output
    res = CliRunner().invoke(main, ["capacity", "--model", "qwen2.5-7b", "--layouts", "4", "-tp", "2"])
    assert res.exit_code != 0 and "drop -tp/-dp" in res.output


@pytest.mark.parametrize("options, message", [
    (dict(model="llama-3-8b", data_parallel_size=2), "dense.*--replicas"),
    (dict(DP8, data_parallel_size=0), "data_parallel_size must be >= 1"),
])
def test_what_data_parallelism_is_not_modelled_with(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(options)


def _step(chunks=(), decodes=0, context=0) -> SchedulerOutput:
    return SchedulerOutput(step=0, chunks=list(chunks), num_decode_reqs=decodes, decode_context_tokens=context,
                           decodes=None, preempted=[], num_running=len(chunks) + decodes, num_waiting=0,
                           num_blocks_used=0, prefix_query_tokens=0, prefix_hit_tokens=0)


def test_a_lockstep_step_lasts_as_long_as_its_slowest_rank():
    """A rank with nothing to do still runs a dummy pass (its weights read, its experts' share of
    the others' tokens); a rank prefilling 4,096 tokens makes the decoding ranks wait for it; the
    expert FLOPs of every rank's tokens are shared evenly over the ranks."""
    spec, gpu = get_model_spec("deepseek-v3"), get_gpu_spec("H200")
    model = RooflineCostModel(spec, gpu, 1, data_parallel_size=8)
    # (DeepSeek-V3's fp8 experts run fp8 matmuls on Hopper: FLOPs counted at the bf16 rate)
    routed = 2.0 * spec.num_moe_layers * spec.num_experts_per_tok * spec.expert_params * gpu.bf16_tflops / gpu.fp8_tflops
    assert model.expert_flops_per_group_token * 8 == pytest.approx(routed)
    assert model.flops_per_token_local == pytest.approx(model.flops_per_token - routed)
    decode = _step(decodes=32, context=32 * 2000)
    prefill = _step([ScheduledChunk(make_request(0, 4096, 1), 0, 4096)])
    idle = model.dp_step_seconds([_step()] * 8)
    assert idle > (model.weight_bytes / model.byte_rate)  # (dummy passes read the weights)
    decodes = model.dp_step_seconds([decode] * 8)
    mixed = model.dp_step_seconds([prefill] + [decode] * 7)
    alone = model.dp_step_seconds([prefill] + [_step()] * 7)
    assert idle < decodes < mixed and alone < mixed
    assert mixed > 3 * decodes  # (the decoding ranks wait for the prefill)


def test_requests_go_where_vllms_dp_load_balancer_sends_them(tmp_path):
    """The rank of least max(in flight, waiting + running) plus 6 x waiting x (KV usage - 0.5)
    when it has waiting requests; ties to the lowest rank; the chosen rank counts one more
    waiting request until the next snapshot."""
    from simkv.replay.data_parallel import DPRouting

    routing = DPRouting(_trace(tmp_path, n=8), 3, 10_000)
    assert [routing.assign(i, 0) for i in range(3)] == [0, 1, 2]  # (each pick adds a waiting request)
    routing.outstanding[:] = [1, 1, 1]
    routing.snapshot = [[0, 2, 0.9], [1, 1, 0.9], [1, 1, 0.4]]
    # scores: max(1, 2) = 2; max(1, 2) + 6 x 1 x 0.4 = 4.4; max(1, 2) + 0 = 2: rank 0 (ties: lowest)
    assert routing.assign(3, 0) == 0
    assert routing.snapshot[0][0] == 1 and routing.outstanding == [2, 1, 1]
    # now rank 0: max(2, 3) + 6 x 1 x 0.4 = 5.4; rank 2: 2
    assert routing.assign(4, 0) == 2
    assert routing.router.describe()["policy"] == "vllm_dp_load_balancer"


def _busy_trace(tmp_path):
    """600 requests in 5 s: enough running for batches to fill the stages."""
    return _trace(tmp_path, n=600, seconds=5.0)


def _trace(tmp_path, n=240, seed=3, seconds=30.0):
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"request_id": [f"q{i}" for i in range(n)],
                          "arrival_time_s": np.sort(rng.uniform(0, seconds, n)),
                          "prompt_tokens": rng.integers(50, 3000, n), "output_tokens": rng.integers(5, 300, n)})
    path = tmp_path / "t.parquet"
    frame.to_parquet(path)
    return read_trace(str(path))


def test_ranks_step_together_and_repeat_themselves(tmp_path):
    """Every rank's steps start at the group's step boundaries and last the group's step; requests
    spread over the ranks (the least outstanding); the same inputs give the same bytes."""
    trace = _trace(tmp_path)
    config = EngineConfig.from_flat(dict(model="deepseek-v2-lite", data_parallel_size=4))
    result = replay(trace, config)
    steps = pd.DataFrame(result.steps)
    assert set(steps["replica"]) == {0, 1, 2, 3}
    per_start = steps.groupby("start_time_s")["duration_s"].nunique()
    assert (per_start == 1).all()  # one duration per boundary, whichever ranks ran
    shared = steps.groupby("start_time_s")["replica"].transform("size") > 1
    assert shared.mean() > 0.5  # (most steps ran alongside another rank's, from the same start)
    ends = set(np.round(steps["start_time_s"] + steps["duration_s"], 9))
    starts = sorted(set(np.round(steps["start_time_s"], 9)))
    assert sum(s in ends for s in starts[1:]) > 0.5 * len(starts)  # (back to back while there is work)
    counts = result.requests["replica"].value_counts()
    assert len(counts) == 4 and counts.min() > 30
    summary = result.summary
    assert summary["num_finished"] == len(trace) and summary["data_parallel"]["data_parallel_size"] == 4
    assert len(summary["data_parallel"]["ranks"]) == 4 and "fleet" not in summary
    again = replay(trace, config)
    assert again.requests.equals(result.requests)
    assert all(np.array_equal(again.steps[k], result.steps[k]) for k in result.steps)


def test_ranks_draft_in_lockstep_too(tmp_path):
    """MTP on data-parallel ranks: each draft pass lasts as long as its slowest rank and takes the
    draft layer's expert share over every rank's tokens; a rank with no drafts to make runs a
    dummy pass. The replay finishes every request and accepts drafts."""
    from simkv.backends.factory import make_backend

    config = EngineConfig.from_flat(dict(model="deepseek-v2-lite", data_parallel_size=2, speculative_method="mtp",
                                         num_speculative_tokens=2))
    backend = make_backend("roofline", config)
    drafter, net = backend.drafter, backend.drafter.network
    assert net.dp == 2 and net.model.num_moe_layers == 1
    chunk = ScheduledChunk(make_request(0, 1003, 10), 1000, 3, num_spec_tokens=2)
    busy = _step([chunk])
    busy.num_spec_tokens_to_schedule = 2
    sampling, context = drafter._sampling(busy)
    first = net.dp_time([drafter._first_work(busy, sampling)], 1)
    later = net.dp_time([net.decode_pass_work(sampling, context)], 1)
    assert drafter.dp_seconds([busy], 1) == pytest.approx(first + later)
    assert drafter.dp_seconds([_step()], 1) == 0.0  # (nobody samples: no drafting)
    target = backend.inner.dp_step_seconds([busy], 1)
    assert target > 0 and backend.dp_step_seconds([busy], 1) == pytest.approx(target + first + later)
    result = replay(_trace(tmp_path, n=60), config)
    spec = result.summary["speculative_decoding"]
    assert result.summary["num_finished"] == 60 and spec["num_accepted_tokens"] > 0


def test_data_parallel_replays_refuse_fleets_and_other_cost_models(tmp_path):
    trace = _trace(tmp_path, n=20)
    config = EngineConfig.from_flat(dict(model="deepseek-v2-lite", data_parallel_size=2))
    with pytest.raises(ValueError, match="lockstep ranks on the roofline"):
        replay(trace, config, cost_model="unit")
    with pytest.raises(ValueError, match=r"with 2 replicas \(--replicas\): DP ranks are one engine"):
        replay(trace, config, fleet=FleetSpec(num_replicas=2))
    res = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--model", "deepseek-v2-lite", "-dp", "2",
                                    "--prefill-replicas", "1", "--decode-replicas", "1", "--out", str(tmp_path / "pd")])
    assert res.exit_code != 0 and "prefill pool: data_parallel_size > 1 is modelled in the decode pool only" in res.output
    res = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--model", "deepseek-v2-lite",
                                    "--prefill-replicas", "1", "--decode-replicas", "2",
                                    "--decode-set", "data_parallel_size=2", "--out", str(tmp_path / "pd")])
    assert res.exit_code != 0 and "one data-parallel engine (--decode-replicas 1)" in res.output
    res = CliRunner().invoke(main, ["goodput", "traces/azure_conv_slice.parquet", "--model", "deepseek-v2-lite",
                                    "-dp", "2", "--goodput", "ttft:2000", "--target-rate", "300"])
    assert res.exit_code != 0 and "searched alone" in res.output
    with pytest.raises(RuntimeError, match="lockstep"):
        RooflineCostModel(get_model_spec("deepseek-v2-lite"), get_gpu_spec("H100-SXM"), data_parallel_size=2).execute(_step())


def test_a_data_parallel_decode_pool(tmp_path):
    """P/D with the decode pool one data-parallel engine of 3 ranks: handoffs go to ranks by vLLM's
    balancer, each rank pulls on its own link, the ranks step in lockstep (a transfer's end or a
    handoff wakes the idle group), every request is served, and the same inputs give the same
    bytes."""
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = _trace(tmp_path)
    config = EngineConfig.from_flat(dict(model="deepseek-v2-lite"))
    spec = DisaggregationSpec(1, 1, decode_options=(("data_parallel_size", 3),))
    result = replay(trace, config, disaggregation=spec)
    summary = result.summary
    assert summary["num_finished"] == len(trace)
    decode = summary["disaggregation"]["decode"]
    assert len(decode["replicas"]) == 3 and decode["router"]["policy"] == "vllm_dp_load_balancer"
    assert decode["config"]["data_parallel_size"] == 3
    assert summary["disaggregation"]["kv_transfer"]["num_pulls"] == len(trace)
    steps = pd.DataFrame(result.steps)
    decode_steps = steps[steps["pool"] == "decode"]
    assert (decode_steps.groupby("start_time_s")["duration_s"].nunique() == 1).all()
    shared = decode_steps.groupby("start_time_s")["replica"].transform("size") > 1
    assert shared.mean() > 0.5
    assert result.requests["decode_replica"].nunique() == 3
    again = replay(trace, config, disaggregation=spec)
    assert again.requests.equals(result.requests)


def test_data_parallel_ranks_under_async_scheduling(tmp_path):
    """Async scheduling on lockstep ranks (vLLM's batch queue for the group): the next step is
    scheduled before the step in flight ends, so the host's share of a step overlaps the
    devices' (lower ITL) and a request waits one step longer for its first (higher TTFT), as on
    one engine; the ranks still step together; a P/D decode pool of such ranks serves everyone."""
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = _trace(tmp_path)
    base = dict(model="deepseek-v2-lite", data_parallel_size=3)
    sync = replay(trace, EngineConfig.from_flat(base)).summary
    result = replay(trace, EngineConfig.from_flat(dict(base, async_scheduling=True)))
    summary = result.summary
    assert summary["num_finished"] == len(trace)
    assert summary["itl_s"]["p50"] < sync["itl_s"]["p50"] and summary["ttft_s"]["p50"] > sync["ttft_s"]["p50"]
    steps = pd.DataFrame(result.steps)
    assert (steps.groupby("start_time_s")["duration_s"].nunique() == 1).all()
    again = replay(trace, EngineConfig.from_flat(dict(base, async_scheduling=True)))
    assert again.requests.equals(result.requests)
    spec = DisaggregationSpec(1, 1, decode_options=(("data_parallel_size", 2),))
    pd_result = replay(trace, EngineConfig.from_flat(dict(model="deepseek-v2-lite", async_scheduling=True)),
                       disaggregation=spec)
    assert pd_result.summary["num_finished"] == len(trace)
    mtp = replay(trace, EngineConfig.from_flat(dict(base, async_scheduling=True, speculative_method="mtp",
                                                    num_speculative_tokens=2))).summary
    assert mtp["num_finished"] == len(trace) and mtp["speculative_decoding"]["drafter_time_s"] > 0


def _sampled(rows):
    """A trace of (arrival s, prompt, output, n) rows."""
    from simkv.traces.schema import trace_from_frame

    return trace_from_frame(pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens", "n"]))


V2_LITE = dict(model="deepseek-v2-lite")


def test_a_rows_sequences_are_routed_one_by_one():
    """vLLM's front end fans a request for n sequences out before its client picks an engine core
    for each: the balancer's snapshot counts each pick as waiting, so 4 sequences arriving
    together alternate over 2 ranks, and only the 2 on one rank share the prompt. The row is the
    rank of its first sequence's, and completes with the last, wherever it ran."""
    trace = _sampled([(0.0, 1000, 50, 4)])
    one = replay(trace, EngineConfig.from_flat(V2_LITE))
    two = replay(trace, EngineConfig.from_flat(dict(V2_LITE, data_parallel_size=2)))
    hits_one, hits_two = (r.summary["prefix_cache_hits_tokens"] for r in (one, two))
    assert hits_one > 0 and 2 * hits_one == 3 * hits_two  # (3 members hit the first's prompt; 1 per rank)
    assert two.requests["prefix_hit_tokens"].tolist() == [hits_two]
    assert two.requests["output_tokens"].tolist() == [200] and two.requests["replica"].tolist() == [0]
    assert two.summary["parallel_sampling"] == {"mode": "fan_out", "sampled_requests": 1, "sequences": 4,
                                                "later_members_prefix_hit_tokens": hits_two,
                                                "mean_ranks_per_sampled_request": 2.0}
    steps = pd.DataFrame(two.steps)
    assert steps.groupby("replica")["num_running"].max().tolist() == [2, 2]
    last_end = (steps["start_time_s"] + steps["duration_s"]).max()
    assert two.requests["finish_time_s"].tolist() == [pytest.approx(last_end)]
    rank0 = steps[steps["replica"] == 0]
    first = rank0[rank0["num_prefill_tokens"] > 0].iloc[0]
    assert two.requests["first_token_time_s"].tolist() == [pytest.approx(first["start_time_s"] + first["duration_s"])]


def test_each_sequence_counts_in_flight_on_its_own_rank():
    """A sequence stops counting where it ran when it finishes. A row's 4 short sequences (2 per
    rank) are done long before a long request on rank 0 is; then three rows arrive half a second
    apart and go to rank 1, rank 0 (a tie: 1 each) and rank 1, as vLLM's balancer sends them. (A
    rank still charged with its finished sequences would get the second and third the other way.)"""
    trace = _sampled([(0.0, 500, 20, 4), (0.01, 300, 3000, 1), (5.0, 300, 400, 1), (5.5, 300, 400, 1),
                      (6.0, 300, 400, 1)])
    result = replay(trace, EngineConfig.from_flat(dict(V2_LITE, data_parallel_size=2)))
    assert result.requests["replica"].tolist() == [0, 0, 1, 0, 1]
    assert result.summary["num_finished"] == 5


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rollouts_on_more_ranks_share_less(async_scheduling):
    """64 rows for 1, 4 or 8 sequences on DeepSeek-V2-Lite: the more ranks, the fewer of a row's
    sequences share a rank, the fewer prompt tokens hit and the more are computed; every row
    completes with all its tokens, and the same inputs give the same bytes."""
    rng = np.random.default_rng(0)
    n = 64
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 2, n)), "prompt_tokens": rng.integers(1000, 3000, n),
                          "output_tokens": rng.integers(100, 600, n), "n": rng.choice([1, 4, 8], n)})
    from simkv.traces.schema import trace_from_frame

    trace = trace_from_frame(frame)
    computed, hits = [], []
    for dp in (1, 2, 4):
        config = EngineConfig.from_flat(dict(V2_LITE, data_parallel_size=dp, async_scheduling=async_scheduling))
        result = replay(trace, config)
        assert (result.requests["output_tokens"] == frame.output_tokens * frame.n).all()
        assert (result.requests["finish_time_s"] <= result.summary["duration_s"] + 1e-9).all()
        computed.append(result.summary["num_prefill_tokens"])
        hits.append(result.summary["prefix_cache_hits_tokens"])
    assert computed[0] < computed[1] < computed[2] and hits[0] > hits[1] > hits[2]
    assert replay(trace, config).requests.equals(result.requests)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_clients_give_up_on_rows_whose_samples_spread_over_ranks(async_scheduling):
    """Clients that give up after 8 s and retry once, on rows for 1 to 8 samples over 4 ranks:
    vLLM aborts every member of a row on its own rank, a retry fans out and is routed again,
    and a row completes on the rank of its last member. Every attempt is accounted for (aborted:
    retried or timed out), no request is left in any rank's scheduler, every rank's count of
    requests in flight returns to zero, and the same inputs give the same bytes."""
    from simkv.backends.factory import make_backend
    from simkv.replay.data_parallel import run_data_parallel
    from simkv.traces.schema import trace_from_frame

    rng = np.random.default_rng(0)
    n = 80
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 3, n)), "prompt_tokens": rng.integers(500, 3000, n),
                          "output_tokens": rng.integers(50, 800, n), "n": rng.choice([1, 2, 4, 8], n)})
    trace = trace_from_frame(frame)
    config = EngineConfig.from_flat(dict(V2_LITE, data_parallel_size=4, async_scheduling=async_scheduling,
                                         client_timeout_s=8.0, client_max_retries=1, num_gpu_blocks=800,
                                         max_model_len=8192))
    result = replay(trace, config)
    client, status = result.summary["client"], result.requests["status"]
    assert set(status) == {"finished", "timed_out"}
    assert client["aborted"] == client["retries"] + client["timed_out_requests"] > 0
    finished = (status == "finished").to_numpy()
    assert (result.requests["output_tokens"][finished] == (frame.output_tokens * frame.n)[finished]).all()
    assert result.summary["parallel_sampling"]["mean_ranks_per_sampled_request"] > 2
    assert replay(trace, config).requests.equals(result.requests)
    runs, routing = run_data_parallel(trace, config, make_backend("roofline", config), 800, compute_capacity(config))
    assert not any(run.scheduler.has_unfinished_requests() for run in runs)
    assert routing.loads_at(1 << 62) == [0, 0, 0, 0] and not routing.rank_of


def _offload_trace(num_fillers: int):
    """A (256 tokens of shared content) at 0 s; fillers of their own content, one a second; B,
    A's prompt again, at 20 s. Each runs alone, and the balancer's stale snapshot sends them to
    ranks 0, 1, 0, 1, ... in turn."""
    from simkv.traces.schema import trace_from_frame

    shared = list(range(1, 17))
    rows = [(0.0, 256, 4, shared)]
    rows += [(1.0 + i, 256, 4, [1000 * (i + 1) + j for j in range(16)]) for i in range(num_fillers)]
    rows.append((20.0, 256, 4, shared))
    frame = pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens", "block_hashes"])
    frame["hash_block_tokens"] = 16
    return trace_from_frame(frame)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_rank_has_its_own_cpu_tier(async_scheduling):
    """KV offloading on DP ranks (vLLM: each DP rank is an engine with its own connector and
    tier). B on the rank whose GPU cache lost A's prompt loads it from that rank's tier (the group
    idle meanwhile sleeps until the load ends); B on the other rank computes it and stores it
    there again; every rank schedules once more after its last request finishes, as one engine."""
    options = dict(V2_LITE, data_parallel_size=2, num_gpu_blocks=40, max_model_len=512, max_num_batched_tokens=512,
                   kv_offloading_size=1.0, async_scheduling=async_scheduling)
    same = replay(_offload_trace(7), EngineConfig.from_flat(options))  # (B: rank 0, as A)
    other = replay(_offload_trace(6), EngineConfig.from_flat(options))  # (B: rank 1)
    assert list(same.requests["replica"]) == [0, 1] * 4 + [0] and list(other.requests["replica"]) == [0, 1] * 4
    hit, miss = same.summary["kv_offloading"], other.summary["kv_offloading"]
    assert hit["loads"] == 1 and hit["loaded_tokens"] == 256 and hit["stored_blocks"] == 8 * 16
    assert miss["loads"] == 0 and miss["stored_blocks"] == 8 * 16  # (A's blocks twice: once on each rank)
    assert [r["kv_offloading_loaded_tokens"] for r in same.summary["data_parallel"]["ranks"]] == [256, 0]
    assert same.summary["num_prefill_tokens"] == 9 * 256 - 255 and other.summary["num_prefill_tokens"] == 8 * 256
    b_hit, b_miss = same.requests["ttft_s"].iloc[-1], other.requests["ttft_s"].iloc[-1]
    load_s = hit["mean_load_s"]
    assert load_s > 0 and b_hit >= load_s and b_hit < b_miss  # (the load, then one token computed)
    assert not any(run.scheduler.offload.has_finished_requests for run in same.fleet_runs + other.fleet_runs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cpu_tiers_on_data_parallel_ranks_serve_coding_sessions(async_scheduling):
    """Coding sessions (40 turns at 33x) on DeepSeek-V2-Lite, 2 ranks of 6,000 blocks: an 8 GiB
    tier per rank serves some of the prompts the ranks' GPU caches lost (less than one engine's
    tier: a session's turns go to either rank), every request is served, and the same inputs give
    the same outputs."""
    from simkv.traces.transform import Edits, transform

    trace = transform(read_trace("traces/kvcache_coding_sessions.parquet"), Edits(head=40, time_scale=0.03))
    options = dict(V2_LITE, data_parallel_size=2, num_gpu_blocks=6000, max_model_len=90_000,
                   async_scheduling=async_scheduling)
    plain = replay(trace, EngineConfig.from_flat(options)).summary
    result = replay(trace, EngineConfig.from_flat(dict(options, kv_offloading_size=8.0)))
    tier = result.summary
    assert tier["num_finished"] == plain["num_finished"] == len(trace) - tier["num_rejected"]
    loaded = tier["kv_offloading"]["loaded_tokens"]
    assert loaded > 30_000 and tier["num_prefill_tokens"] < plain["num_prefill_tokens"]
    assert sum(r["kv_offloading_loaded_tokens"] for r in tier["data_parallel"]["ranks"]) == loaded
    again = replay(trace, EngineConfig.from_flat(dict(options, kv_offloading_size=8.0)))
    assert again.requests.equals(result.requests)


def _sessions():
    """300 turns of 60 chat sessions (first prompts ~3,000 tokens, replies read back), a session
    a second."""
    from simkv.traces.arrivals import ArrivalProcess
    from simkv.traces.synth import ClippedLognormal
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    shape = SessionShape(sessions=60, turns=5, first_prompt=ClippedLognormal(8.0, 0.5, 8, 8000), think_time_s=2.0)
    return multi_turn(shape, seed=5, arrival=ArrivalProcess("poisson", 1.0))


def test_a_router_in_front_of_the_ranks():
    """`-dp N --router POLICY` (vLLM's --data-parallel-external-lb: each rank behind its own API
    server, an external router picking): the fleet's routers pick ranks instead of vLLM's
    balancer, which routes by load and scatters a session's turns over the ranks. round_robin
    splits the turns evenly; prefix_aware keeps a session on the rank holding its prefix and hits
    far more of the prompts; each rank still steps in lockstep."""
    from simkv.replay.api import FleetSpec

    trace = _sessions()
    config = EngineConfig.from_flat(dict(V2_LITE, data_parallel_size=2, num_gpu_blocks=3000, max_model_len=32768))
    balancer = replay(trace, config)
    turns = replay(trace, config, fleet=FleetSpec(router="round_robin"))
    aware = replay(trace, config, fleet=FleetSpec(router="prefix_aware"))
    policies = [r.summary["data_parallel"]["router"]["policy"] for r in (balancer, turns, aware)]
    assert policies == ["vllm_dp_load_balancer", "round_robin", "prefix_aware"]
    assert all(r.summary["num_finished"] == len(trace) for r in (balancer, turns, aware))
    assert turns.requests["replica"].value_counts().tolist() == [150, 150]
    rates = [r.summary["prefix_cache_hit_rate"] for r in (balancer, turns, aware)]
    assert rates[2] > rates[0] + 0.15 and rates[2] > rates[1] + 0.15
    steps = pd.DataFrame(aware.steps)
    assert (steps.groupby("start_time_s")["duration_s"].nunique() == 1).all()
    with pytest.raises(ValueError, match=r"with 2 replicas \(--replicas\)"):
        replay(trace, config, fleet=FleetSpec(2, "prefix_aware"))


def test_a_rows_samples_stay_on_the_rank_its_router_picked():
    """Behind an external router a row's n sequences go to one rank's API server, which fans them
    out there (vLLM's balancer would spread them): all 4 share the prompt on rank 0."""
    from simkv.replay.api import FleetSpec

    trace = _sampled([(0.0, 1000, 50, 4)])
    one = replay(trace, EngineConfig.from_flat(V2_LITE))
    routed = replay(trace, EngineConfig.from_flat(dict(V2_LITE, data_parallel_size=2)),
                    fleet=FleetSpec(router="round_robin"))
    assert routed.summary["prefix_cache_hits_tokens"] == one.summary["prefix_cache_hits_tokens"] > 0
    steps = pd.DataFrame(routed.steps)
    assert steps.groupby("replica")["num_running"].max().to_dict() == {0: 4}
    assert routed.requests["output_tokens"].tolist() == [200]


def test_the_cli_puts_a_router_in_front_of_the_ranks(tmp_path):
    out = tmp_path / "r"
    res = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--model", "deepseek-v2-lite", "-dp", "2",
                                    "--router", "prefix_aware", "--router-option", "cache_threshold=0.5",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    router = json.loads((out / "summary.json").read_text())["data_parallel"]["router"]
    assert router["policy"] == "prefix_aware" and router["options"]["cache_threshold"] == 0.5


def test_behind_a_router_each_rank_admits_for_itself():
    """400 requests at once, --max-num-queued-reqs 20: vLLM's one API server in front of both
    ranks admits 20; behind a router each rank's own API server admits 20."""
    from simkv.replay.api import FleetSpec

    trace = read_trace("traces/req400.parquet")
    config = EngineConfig.from_flat(dict(V2_LITE, data_parallel_size=2, max_num_queued_reqs=20))
    assert replay(trace, config).summary["num_finished"] == 20
    assert replay(trace, config, fleet=FleetSpec(router="round_robin")).summary["num_finished"] == 40


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ranks_with_pipeline_stages(tmp_path, async_scheduling):
    """DP 2 x PP 2: one batch queue for the group, P batches deep (P + 1 async); the ranks' batches
    of one place go through the stages together (one start and one end for all of them), each
    rank's scheduler is the pipelined engine's, every request is served, and the same inputs give
    the same bytes. Against DP 2 without stages, the pipeline keeps two batches in flight."""
    trace = _busy_trace(tmp_path)
    base = dict(model="deepseek-v2-lite", data_parallel_size=2, async_scheduling=async_scheduling)
    config = EngineConfig.from_flat(base | {"pipeline_parallel_size": 2})
    result = replay(trace, config)
    summary = result.summary
    assert summary["num_finished"] == len(trace) and summary["data_parallel"]["data_parallel_size"] == 2
    pipeline = summary["pipeline"]
    assert pipeline["pipeline_parallel_size"] == 2 and 0 < pipeline["stage_busy_fraction"] <= 1
    steps = pd.DataFrame(result.steps)
    assert set(steps["replica"]) == {0, 1}
    assert (steps.groupby("start_time_s")["duration_s"].nunique() == 1).all()  # (a place's batches together)
    assert (steps.groupby("start_time_s")["replica"].transform("size") > 1).mean() > 0.5
    # two places in flight: most batches start before the one ahead of them has ended
    ordered = steps.drop_duplicates("start_time_s").sort_values("start_time_s")
    starts, ends = ordered["start_time_s"].to_numpy(), (ordered["start_time_s"] + ordered["duration_s"]).to_numpy()
    assert (starts[1:] < ends[:-1] - 1e-9).mean() > 0.8
    flat = replay(trace, EngineConfig.from_flat(base))
    assert summary["duration_s"] < flat.summary["duration_s"]  # (the stages work on two batches at once)
    again = replay(trace, config)
    assert again.requests.equals(result.requests)
    assert all(np.array_equal(again.steps[k], result.steps[k]) for k in result.steps)


def test_stage_weights_split_the_experts_over_the_ranks():
    """Under DP x PP each stage's GPUs hold their layers' share of the attention and dense layers
    split by TP, and of the routed experts split over every rank's TP GPUs."""
    spec = get_model_spec("deepseek-v3")
    one = compute_capacity(EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", tensor_parallel_size=8,
                                                       pipeline_parallel_size=2)))
    two = compute_capacity(EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", tensor_parallel_size=8,
                                                       pipeline_parallel_size=2, data_parallel_size=2)))
    share = one.pipeline_layers[one.pipeline_binding_stage] / spec.num_layers
    assert one.pipeline_stage_weight_bytes - two.pipeline_stage_weight_bytes == pytest.approx(
        spec.routed_expert_bytes * share / 16, rel=1e-6)
    assert two.num_gpu_blocks > one.num_gpu_blocks


def test_ranks_with_stages_draft_on_their_last_stages(tmp_path):
    """DP 2 x PP 2 with MTP (async scheduling, as pipeline stages need): the ranks' drafters run
    on the last stage after the target's layers, in lockstep; accepted drafts shorten the replay."""
    trace = _busy_trace(tmp_path)
    base = dict(model="deepseek-v2-lite", data_parallel_size=2, pipeline_parallel_size=2, async_scheduling=True)
    plain = replay(trace, EngineConfig.from_flat(base))
    mtp = replay(trace, EngineConfig.from_flat(base | dict(speculative_method="mtp", num_speculative_tokens=1,
                                                           spec_acceptance_rate=0.9)))
    spec = mtp.summary["speculative_decoding"]
    assert mtp.summary["num_finished"] == len(trace) and spec["num_accepted_tokens"] > 0
    assert spec["drafter_time_s"] > 0 and spec["drafter_time_share"] > 0
    assert mtp.summary["pipeline"]["batches"] < plain.summary["pipeline"]["batches"]


def test_a_data_parallel_decode_pool_with_pipeline_stages(tmp_path):
    """P/D with the decode pool one engine of 2 DP ranks x 2 stages: the group's batch queue runs
    it (one set of stage clocks, counted once in the pool's pipeline section), and every request
    is served."""
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = _busy_trace(tmp_path)
    config = EngineConfig.from_flat(dict(model="deepseek-v2-lite", async_scheduling=True))
    spec = DisaggregationSpec(1, 1, decode_options=(("data_parallel_size", 2), ("pipeline_parallel_size", 2)))
    result = replay(trace, config, disaggregation=spec)
    decode = result.summary["disaggregation"]["decode"]
    assert result.summary["num_finished"] == len(trace) and decode["pipeline"]["pipeline_parallel_size"] == 2
    steps = pd.DataFrame(result.steps)
    decode_steps = steps[steps["pool"] == "decode"]
    assert decode["pipeline"]["batches"] == decode_steps["start_time_s"].nunique()


def test_layouts_include_ranks_of_pipelines():
    """`simkv capacity --layouts 16` on a mixture of experts lists data-parallel ranks of pipeline
    stages too, each rank's pool counted once per rank."""
    res = CliRunner().invoke(main, ["capacity", "--model", "deepseek-v3", "--gpu", "H200", "--layouts", "16", "--json"])
    rows = {r["layout"]: r for r in json.loads(res.output)["layouts"]}
    row = rows["DP 2 x TP 4 x PP 2"]
    assert (row["tensor_parallel_size"], row["data_parallel_size"], row["pipeline_parallel_size"]) == (4, 2, 2)
    cap = compute_capacity(EngineConfig.from_flat(dict(DP8, tensor_parallel_size=4, data_parallel_size=2,
                                                       pipeline_parallel_size=2)))
    assert row["kv_cache_tokens_all"] == 2 * cap.kv_cache_tokens
    assert row["weight_bytes_per_gpu"] == cap.pipeline_stage_weight_bytes
    dense = CliRunner().invoke(main, ["capacity", "--model", "qwen2.5-7b", "--layouts", "4", "--json"])
    assert not any(r["data_parallel_size"] > 1 for r in json.loads(dense.output)["layouts"])


def _three_requests(gap_s: float):
    """A request at 0, one `gap_s` later, and one 100 s after that."""
    from simkv.traces.schema import trace_from_frame

    return trace_from_frame(pd.DataFrame({"arrival_time_s": [0.0, gap_s, gap_s + 100.0],
                                          "prompt_tokens": [300, 200, 100], "output_tokens": [4, 3, 2]}))


def test_a_wave_whose_requests_finished_runs_dummy_passes_until_its_sync_step():
    """vLLM's DP engine core agrees on the wave's end only on its first step and every
    dp_sync_interval steps (16): the group runs dummy passes until then, and a request arriving
    meanwhile waits for the pass under way and joins the wave. With an interval of 1 the wave ends
    after its last step and the group sleeps until the arrival."""
    options = dict(model="deepseek-v2-lite", gpu="H100-SXM", data_parallel_size=2)
    sleepy = EngineConfig.from_flat(options | {"dp_sync_interval": 1})
    first = replay(_three_requests(100.0), sleepy)
    finish = float(pd.DataFrame(first.requests).sort_values("arrival_time_s")["finish_time_s"].iloc[0])
    assert first.summary["data_parallel"]["wave_tail_dummy_passes"] == 0
    # the second request arrives 1 ms after the first finished: within the tail's first dummy pass
    trace = _three_requests(finish + 0.001)
    ended = pd.DataFrame(replay(trace, sleepy).requests).sort_values("arrival_time_s")
    assert ended["first_scheduled_time_s"].iloc[1] == pytest.approx(finish + 0.001, abs=1e-6)
    waved = replay(trace, EngineConfig.from_flat(options))
    rows = pd.DataFrame(waved.requests).sort_values("arrival_time_s")
    dummy = RooflineCostModel(get_model_spec("deepseek-v2-lite"), get_gpu_spec("H100-SXM"),
                              data_parallel_size=2).dp_step_seconds([], 2)
    assert 0.001 < dummy and rows["first_scheduled_time_s"].iloc[1] == pytest.approx(finish + dummy, abs=1e-6)
    # the third comes long after the wave ended: at once, as without the tail
    assert rows["first_scheduled_time_s"].iloc[2] == pytest.approx(rows["arrival_time_s"].iloc[2], abs=1e-6)
    # the first wave: 4 + 3 steps and 1 dummy pass between them, then 8 more to its 16th step;
    # the last wave ends with the trace
    assert waved.summary["data_parallel"]["dp_sync_interval"] == 16
    assert pd.DataFrame(waved.steps)["start_time_s"].nunique() == 4 + 3 + 2
    assert waved.summary["data_parallel"]["wave_tail_dummy_passes"] == 1 + 8
    # under async scheduling the same: the arrival waits for the dummy pass
    async_options = options | {"async_scheduling": True}
    async_first = replay(_three_requests(100.0), EngineConfig.from_flat(async_options | {"dp_sync_interval": 1}))
    async_finish = float(pd.DataFrame(async_first.requests).sort_values("arrival_time_s")["finish_time_s"].iloc[0])
    async_waved = replay(_three_requests(async_finish + 0.001), EngineConfig.from_flat(async_options))
    async_rows = pd.DataFrame(async_waved.requests).sort_values("arrival_time_s")
    assert async_rows["first_scheduled_time_s"].iloc[1] == pytest.approx(async_finish + dummy, abs=1e-6)
    assert async_waved.summary["data_parallel"]["wave_tail_dummy_passes"] == 1 + 8
