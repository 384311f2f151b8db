"""A fleet of replicas behind a router: the same engines, routed requests, exact bookkeeping."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import CacheConfig, EngineConfig, SchedulerConfig
from simkv.replay.api import FleetSpec, replay
from simkv.replay.fleet import fleet_tables, run_fleet
from simkv.replay.router import PrefixIndex, Router, RouterError, RouterOptions
from simkv.backends.factory import make_backend
from simkv.traces.arrivals import ArrivalProcess
from simkv.traces.schema import take_rows, trace_from_frame
from simkv.traces.synth_prefix import PrefixGroups, shared_prefix
from simkv.traces.synth_sessions import SessionShape, multi_turn
from tests.core.helpers import assert_decode_runs_change_no_bytes

LATENCIES = ["first_scheduled_time_s", "first_token_time_s", "finish_time_s", "ttft_s", "e2e_s", "queue_s"]


def config(num_gpu_blocks=300, **sched):
    return EngineConfig(CacheConfig(num_gpu_blocks=num_gpu_blocks),
                        SchedulerConfig(**{"max_model_len": 2048, "max_num_batched_tokens": 512, **sched}))


def loaded_trace(n=150, seed=0):
    rng = np.random.default_rng(seed)
    return trace_from_frame(pd.DataFrame({
        "arrival_time_s": np.sort(rng.uniform(0, 4, n)), "prompt_tokens": rng.integers(1, 600, n),
        "output_tokens": rng.integers(1, 120, n)}))


def frame(rows):
    return trace_from_frame(pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens"]))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_fleet_of_one_is_the_plain_replay(async_scheduling):
    trace, cfg = loaded_trace(), config(async_scheduling=async_scheduling)
    plain = replay(trace, cfg, "roofline")
    capacity = compute_capacity(cfg)
    runs, routing = run_fleet(trace, cfg, [make_backend("roofline", cfg)], capacity.num_gpu_blocks,
                              Router("least_outstanding", 1), capacity)
    requests, steps, _ = fleet_tables(runs, routing, trace)
    pd.testing.assert_frame_equal(requests.drop(columns="replica"), plain.requests)
    for name, values in plain.steps.items():
        assert np.array_equal(steps[name], values), name
    assert plain.summary["num_preemptions"] > 0  # a loaded engine: the comparison covers preemption


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_round_robin_replicas_replay_exactly_their_share_of_the_trace(async_scheduling):
    """Round-robin routing does not look at the replicas, so each replica must behave exactly as
    an engine replaying its own rows alone: the shared clock and the routing add nothing."""
    trace, cfg, n = loaded_trace(240), config(async_scheduling=async_scheduling), 3
    fleet = replay(trace, cfg, "roofline", fleet=FleetSpec(n, "round_robin"))
    assert fleet.requests["replica"].tolist() == [i % n for i in range(len(trace))]
    for r in range(n):
        rows = np.arange(r, len(trace), n)
        alone = replay(take_rows(trace, rows), cfg, "roofline")
        mine = fleet.requests.iloc[rows].reset_index(drop=True)
        pd.testing.assert_frame_equal(mine[LATENCIES], alone.requests[LATENCIES])
        assert fleet.summary["fleet"]["replicas"][r]["num_steps"] == alone.summary["num_steps"]
        assert fleet.summary["fleet"]["replicas"][r]["num_preemptions"] == alone.summary["num_preemptions"]
    s = fleet.summary
    assert s["num_finished"] == len(trace)
    assert s["num_steps"] == sum(row["num_steps"] for row in s["fleet"]["replicas"])
    assert s["duration_s"] == max(row["duration_s"] for row in s["fleet"]["replicas"])


@pytest.mark.parametrize("router, async_scheduling", [("least_outstanding", False), ("prefix_aware", False),
                                                      ("prefix_aware", True)])
def test_decode_runs_do_not_change_routing(router, async_scheduling, tmp_path):
    trace = shared_prefix(PrefixGroups(groups=6), n_requests=300, seed=3, arrival=ArrivalProcess("poisson", rate=30.0))
    cfg = config(num_gpu_blocks=400, async_scheduling=async_scheduling)
    assert_decode_runs_change_no_bytes(trace, cfg, tmp_path, fleet=FleetSpec(3, router))


def test_least_outstanding_counts_a_finish_only_strictly_before_the_arrival():
    # unit model: every step lasts 1 s. Request 1 (one output token) finishes at t = 1 on replica 1;
    # request 0 stays busy on replica 0 until t = 50.
    cfg = config()
    for arrival, expected in ((1.5, 1), (1.0, 0)):
        trace = frame([(0.0, 10, 50), (0.0, 10, 1), (arrival, 10, 5)])
        res = replay(trace, cfg, "unit", fleet=FleetSpec(2, "least_outstanding"))
        # at 1.5 replica 1 is free; at exactly 1.0 its finish has not happened yet: loads tie 1-1,
        # and the tie goes to the replica after the last one chosen (1), i.e. replica 0
        assert res.requests["replica"].tolist() == [0, 1, expected], arrival
    res = replay(frame([(0.0, 10, 50), (0.0, 10, 1), (1.5, 10, 5)]), cfg, "unit", fleet=FleetSpec(2, "round_robin"))
    assert res.requests["replica"].tolist() == [0, 1, 0]


def test_prefix_aware_keeps_conversations_on_the_replica_that_caches_them():
    trace = multi_turn(SessionShape(sessions=120, turns=5, think_time_s=8), seed=2,
                       arrival=ArrivalProcess("poisson", rate=3.0))
    cfg = EngineConfig.from_flat({"num_gpu_blocks": 3000})
    results = {router: replay(trace, cfg, fleet=FleetSpec(4, router)).summary
               for router in ("round_robin", "prefix_aware")}
    rr, pa = results["round_robin"], results["prefix_aware"]
    assert pa["prefix_cache_hit_rate"] > 2 * rr["prefix_cache_hit_rate"]
    assert pa["fleet"]["router"]["decisions"]["prefix_match"] > len(trace) / 2
    assert pa["ttft_s"]["p50"] < rr["ttft_s"]["p50"]


def test_prefix_aware_rebalances_a_prompt_every_request_shares():
    # one system prompt for all: pure affinity would send everything to one replica
    trace = shared_prefix(PrefixGroups(groups=1), n_requests=400, seed=1, arrival=ArrivalProcess("poisson", rate=200.0))
    opts = RouterOptions(balance_abs=8, balance_rel=1.5)
    res = replay(trace, config(num_gpu_blocks=2000, max_model_len=8192), "roofline",
                 fleet=FleetSpec(4, "prefix_aware", opts))
    decisions = res.summary["fleet"]["router"]["decisions"]
    assert decisions.get("rebalance", 0) > 0 and decisions["prefix_match"] > 0
    # once a rebalanced request has taken the prompt to every replica, all match it equally
    counts = res.requests["replica"].value_counts()
    assert sorted(counts.index) == [0, 1, 2, 3] and counts.max() < 0.3 * len(trace)


def test_prefix_index_forgets_the_least_recently_sent_blocks():
    index = PrefixIndex(capacity_tokens=64)
    index.insert([1, 2, 3], 16)
    index.insert([1, 4], 16)  # 1 refreshed; 4 fills the capacity
    assert index.matched_blocks([1, 2, 3]) == 3
    index.insert([5], 16)  # evicts 2, the least recently sent
    assert index.matched_blocks([1, 2, 3]) == 1 and index.matched_blocks([4, 5]) == 2
    assert index.tokens == 64


def test_router_options_and_names_are_checked():
    assert RouterOptions.parse(["cache_threshold=0.5", "balance-abs=10"]) == RouterOptions(0.5, 10, 1.5)
    for bad in (["cache_threshold"], ["speed=1"], ["balance_abs=x"], ["cache_threshold=2"], ["balance_rel=0.5"]):
        with pytest.raises(RouterError):
            RouterOptions.parse(bad)
    with pytest.raises(RouterError, match="unknown router"):
        Router("random", 2)
    with pytest.raises(RouterError, match="replicas must be a whole number >= 1"):
        Router("round_robin", 0)


def test_fleet_rejects_prompts_too_long_for_every_replica():
    trace = frame([(0.0, 5000, 3), (0.0, 10, 3), (0.1, 10, 3)])
    res = replay(trace, config(), "unit", fleet=FleetSpec(2, "round_robin"))
    assert res.requests["status"].tolist() == ["rejected", "finished", "finished"]
    assert res.requests["replica"].tolist() == [-1, 0, 1]
    assert res.summary["num_rejected"] == 1 and res.summary["num_finished"] == 2


def test_cli_fleet_replay_writes_the_usual_files_deterministically(tmp_path):
    runner = CliRunner()
    args = ["replay", "traces/req400_prefix10.parquet", "--quiet", "--num-gpu-blocks", "3000",
            "--max-model-len", "4096", "--replicas", "3", "--router", "prefix_aware"]
    for name in ("x", "y"):
        r = runner.invoke(main, args + ["--out", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
    for f in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "x" / f).read_bytes() == (tmp_path / "y" / f).read_bytes()
    s = json.loads((tmp_path / "x" / "summary.json").read_text())
    assert s["fleet"]["num_replicas"] == 3 and len(s["fleet"]["replicas"]) == 3
    assert sum(row["num_requests"] for row in s["fleet"]["replicas"]) == s["num_requests"] == 400
    steps = pd.read_parquet(tmp_path / "x" / "steps.parquet")
    assert sorted(steps["replica"].unique()) == [0, 1, 2]
    assert "3 replicas behind a prefix_aware router" in (tmp_path / "x" / "report.html").read_text()


@pytest.mark.parametrize("extra, message", [
    (["--replicas", "0"], "--replicas"),
    (["--replicas", "2", "--backend", "gpu"], "--replicas"),
    (["--replicas", "2", "--router-option", "cache_threshold=0.5"], "--router prefix_aware"),
    (["--replicas", "2", "--router", "prefix_aware", "--router-option", "nope=1"], "--router-option"),
])
def test_cli_fleet_errors_name_the_option(extra, message, tmp_path):
    r = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--quiet", "--out", str(tmp_path / "o")] + extra)
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_config_file_may_give_the_fleet_and_flags_override_it(tmp_path):
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text("num_gpu_blocks: 3000\nmax_model_len: 4096\nreplicas: 2\nrouter: prefix_aware\n"
                   "router_options: {cache_threshold: 0.5}\n")
    runner = CliRunner()
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--quiet", "--config", str(cfg), "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    fleet = json.loads((tmp_path / "a" / "summary.json").read_text())["fleet"]
    assert fleet["num_replicas"] == 2 and fleet["router"]["policy"] == "prefix_aware"
    assert fleet["router"]["options"]["cache_threshold"] == 0.5
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--quiet", "--config", str(cfg), "--replicas", "3",
                             "--router", "prefix_aware", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["fleet"]["num_replicas"] == 3
    cfg.write_text("replicas: 2\nrouter: fastest\n")
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--quiet", "--config", str(cfg), "--out", str(tmp_path / "c")])
    assert r.exit_code == 2 and "router must be one of" in r.output and "--config" in r.output


def test_prefix_aware_matches_whole_prefixes_within_one_cache_salt():
    from simkv.replay.router import chained

    a, b = chained(np.array([1, 2, 3])), chained(np.array([9, 2, 3]))
    assert a[0] != b[0] and a[1] != b[1]  # block 1 matches only where block 0 does too
    assert chained(np.array([1, 2]), "tenant-a") != chained(np.array([1, 2]), "tenant-b")
    index = PrefixIndex(capacity_tokens=1000)
    index.insert(a, 16)
    assert index.matched_blocks(chained(np.array([1, 2, 7]))) == 2 and index.matched_blocks(b) == 0
    # four salted tenants with one system prompt: no tenant's prompt matches another's cache
    rows = pd.DataFrame({"arrival_time_s": np.arange(40) * 0.05, "prompt_tokens": 64, "output_tokens": 4,
                         "block_hashes": [[1, 2, 3, 4]] * 40, "cache_salt": [f"t{i % 4}" for i in range(40)]})
    trace = trace_from_frame(rows, hash_block_tokens=16)
    res = replay(trace, config(), "roofline", fleet=FleetSpec(4, "prefix_aware"))
    by_tenant = res.requests.assign(tenant=[f"t{i % 4}" for i in range(40)]).groupby("tenant")["replica"].nunique()
    assert (by_tenant == 1).all() and res.requests["replica"].nunique() == 4  # each tenant kept on one replica


def test_fleet_ratios_are_pooled_and_mean_running_is_over_all_steps():
    cfg = EngineConfig(CacheConfig(num_gpu_blocks=600, allocator="contiguous"),
                       SchedulerConfig(max_model_len=512, max_num_batched_tokens=512))
    trace = frame([(0.01 * i, 400 if i % 2 == 0 else 20, 60 if i % 2 == 0 else 2) for i in range(40)])
    res = replay(trace, cfg, "roofline", fleet=FleetSpec(2, "round_robin"))  # long on 0, short on 1
    managers = [run.scheduler.kv_cache_manager for run in res.fleet_runs]
    pooled = 100 * sum(m.reserved_unwritten_slots for m in managers) / sum(m.reserved_slots for m in managers)
    assert res.summary["allocator_stats"]["reservation_waste_pct"] == pytest.approx(pooled)
    assert res.summary["mean_running"] == pytest.approx(float(np.mean(res.steps["num_running"])))


def test_config_file_errors_name_the_file_and_flags_override_key_by_key(tmp_path):
    from simkv.cli.replay_cmd import read_fleet
    import click

    cfg = tmp_path / "f.yaml"
    cfg.write_text("router: prefix_aware\nrouter_options: {cache_threshold: 0.5}\n")
    spec = read_fleet(2, None, ("balance_abs=4",), str(cfg))
    assert (spec.options.cache_threshold, spec.options.balance_abs) == (0.5, 4)
    assert read_fleet(2, "least_outstanding", (), str(cfg)).router == "least_outstanding"  # the flag wins
    for text, message in (("replicas: 0\n", "replicas must be a whole number >= 1"),
                          ("router_options: {balance_abs: 10.5}\nrouter: prefix_aware\n", "is not a int")):
        cfg.write_text(text)
        with pytest.raises(click.BadParameter) as info:
            read_fleet(None, None, (), str(cfg))
        assert message in str(info.value) and str(cfg) in str(info.value) and info.value.param_hint == "--config"


def test_session_affinity_keeps_every_turn_of_a_conversation_on_one_replica():
    import hashlib
    from dataclasses import replace as with_fields

    from simkv.replay.router import session_replica

    # rendezvous hashing: the replica whose md5 of "session/replica" is highest, whatever the order given
    weights = {r: hashlib.md5(f"chat-7/{r}".encode()).digest() for r in range(4)}
    assert session_replica("chat-7", (0, 1, 2, 3)) == max(weights, key=weights.get)
    assert session_replica("chat-7", (3, 1, 2, 0)) == session_replica("chat-7", (0, 1, 2, 3))
    # a replica removed moves only the sessions it held
    sessions = [f"s{k}" for k in range(400)]
    before = {s: session_replica(s, (0, 1, 2, 3)) for s in sessions}
    after = {s: session_replica(s, (0, 1, 3)) for s in sessions}
    assert all(after[s] == before[s] for s in sessions if before[s] != 2)
    assert 70 < sum(before[s] == 2 for s in sessions) < 130  # (about a quarter each)
    trace = multi_turn(SessionShape(sessions=120, turns=5, think_time_s=8), seed=2,
                       arrival=ArrivalProcess("poisson", rate=3.0))
    cfg = EngineConfig.from_flat({"num_gpu_blocks": 3000})
    result = replay(trace, cfg, fleet=FleetSpec(4, "session_affinity"))
    replicas = pd.Series(result.requests["replica"].to_numpy(), index=trace.session_id)
    assert (replicas.groupby(level=0).nunique() == 1).all()
    assert {s: int(r) for s, r in replicas.groupby(level=0).first().items()} == {
        s: session_replica(s, (0, 1, 2, 3)) for s in set(trace.session_id)}
    assert result.summary["fleet"]["router"]["decisions"] == {"session": len(trace)}
    rr = replay(trace, cfg, fleet=FleetSpec(4, "round_robin")).summary
    assert result.summary["prefix_cache_hit_rate"] > 2 * rr["prefix_cache_hit_rate"]
    # requests without a session go to the least loaded replica
    loose = with_fields(trace, session_id=np.array([None] * len(trace), dtype=object))
    assert replay(loose, cfg, fleet=FleetSpec(4, "session_affinity")).summary["fleet"]["router"]["decisions"] == {
        "least_loaded": len(trace)}
    # a class with replicas of its own: its sessions hash over those only
    router = Router("session_affinity", 4, class_replicas=(("docs", (2, 3)),))
    assert router.choose([0] * 4, None, 0, None, "docs", "chat-7") == session_replica("chat-7", (2, 3))
    assert router.choose([0] * 4, None, 0, None, "chat", "chat-7") == session_replica("chat-7", (0, 1))


def test_replicas_may_run_different_engines():
    from simkv.config import ConfigError

    trace = loaded_trace(200, seed=5)
    cfg = EngineConfig.from_flat({"max_model_len": 2048, "max_num_batched_tokens": 512})
    plain = replay(trace, cfg, fleet=FleetSpec(3, "least_outstanding"))
    same = replay(trace, cfg, fleet=FleetSpec(3, "least_outstanding", replica_sets=(((2,), (("gpu", "H100-SXM"),)),)))
    pd.testing.assert_frame_equal(plain.requests, same.requests)  # (a set of the common engine changes nothing)
    mixed = replay(trace, cfg, fleet=FleetSpec(3, "least_outstanding",
                                               replica_sets=(((1, 2), (("gpu", "H200"), ("max_num_seqs", 8))),)))
    rows = mixed.summary["fleet"]["replicas"]
    h200 = EngineConfig.from_flat(cfg.given_options() | {"gpu": "H200", "max_num_seqs": 8})
    assert [(r["gpu"], r["num_gpu_blocks"], r["max_num_seqs"]) for r in rows] == [
        ("H100-SXM", compute_capacity(cfg).num_gpu_blocks, cfg.scheduler.max_num_seqs),
        ("H200", compute_capacity(h200).num_gpu_blocks, 8), ("H200", compute_capacity(h200).num_gpu_blocks, 8)]
    assert mixed.summary["fleet"]["replica_sets"] == [{"replicas": [1, 2], "options": {"gpu": "H200", "max_num_seqs": 8}}]
    assert mixed.summary["num_gpu_blocks"] == compute_capacity(h200).num_gpu_blocks  # (the largest replica's)
    steps = pd.DataFrame(mixed.steps)
    assert steps[steps["replica"] > 0]["num_running"].max() <= 8 < steps[steps["replica"] == 0]["num_running"].max()
    # the prefix-aware router's index holds as many tokens as each replica's cache
    router = Router("prefix_aware", 2, cache_tokens_per_replica=[100, 300])
    assert [index.capacity_tokens for index in router.indexes] == [100, 300]
    for sets, message in (((((3,), (("gpu", "H200"),)),), "replica 3 is not one of the fleet's 0-2"),
                          ((((1,), (("gpu", "H200"),)), ((1,), (("gpu", "A100-80GB"),))), "replica 1 is in two sets")):
        with pytest.raises(RouterError, match=message):
            FleetSpec(3, replica_sets=sets)
    for options, message in (((("gpu", "Z9"),), "--replica-set 1: unknown GPU 'Z9'"),
                             ((("max_model_len", 1024),), "max_model_len 1024 differs from the fleet's 2048")):
        with pytest.raises(ConfigError, match=message):
            replay(trace, cfg, fleet=FleetSpec(3, replica_sets=(((1,), options),)))
    # LoRA adapters: each replica its own slots (a set may change max_loras), but all or none take them
    from simkv.traces.lora import assign_adapters

    named = assign_adapters(trace, 6, 1.0, 0)
    lora = EngineConfig.from_flat(cfg.given_options() | {"enable_lora": True, "max_loras": 1})
    mixed = replay(named, lora, fleet=FleetSpec(3, "least_outstanding",
                                                replica_sets=(((1, 2), (("gpu", "H200"), ("max_loras", 4))),)))
    rows = mixed.summary["fleet"]["replicas"]
    assert [r["max_loras"] for r in rows] == [1, 4, 4] and mixed.summary["lora"]["max_loras"] == 4
    alone = [replay(named, lora, fleet=FleetSpec(3, "least_outstanding")).summary["lora"]["deferrals"]]
    assert mixed.summary["lora"]["deferrals"] < alone[0]  # (four slots on two replicas: fewer waits for one)
    with pytest.raises(ConfigError, match="enable_lora differs from the fleet's"):
        replay(named, lora, fleet=FleetSpec(3, replica_sets=(((1,), (("enable_lora", False),)),)))


def test_replicas_of_different_engines_keep_cpu_tiers_of_their_own():
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=60, turns=4, think_time_s=2), seed=3,
                       arrival=ArrivalProcess("poisson", rate=4.0))
    cfg = EngineConfig.from_flat({"num_gpu_blocks": 400, "kv_offloading_size": 1, "max_model_len": 6000})
    plain = replay(trace, cfg, fleet=FleetSpec(2, "session_affinity"))
    same = replay(trace, cfg, fleet=FleetSpec(2, "session_affinity", replica_sets=(((1,), (("kv_offloading_size", 1),)),)))
    pd.testing.assert_frame_equal(plain.requests, same.requests)  # (a set of the common engine changes nothing)
    mixed = replay(trace, cfg, fleet=FleetSpec(2, "session_affinity",
                                               replica_sets=(((1,), (("kv_offloading_size", 2),)),)))
    rows = mixed.summary["fleet"]["replicas"]
    tier = mixed.summary["kv_offloading"]
    assert [r["cpu_tier_gib"] for r in rows] == [1.0, 2.0] and tier["cpu_tier_gib"] == 2.0  # (the largest)
    assert tier["loaded_tokens"] == sum(r["kv_offloading_loaded_tokens"] for r in rows) > 0


def test_cli_replica_sets(tmp_path):
    trace = loaded_trace(60, seed=6)
    path = tmp_path / "t.parquet"
    from simkv.traces.schema import write_trace

    write_trace(trace, path)
    result = CliRunner().invoke(main, ["replay", str(path), "--replicas", "2", "--replica-set", "1:gpu=H200",
                                       "--max-model-len", "2048", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "r" / "summary.json").read_text())["fleet"]["replicas"]
    assert [row["gpu"] for row in rows] == ["H100-SXM", "H200"] and "per replica" in result.output
    for args, message in ((["--replica-set", "1"], "expected REPLICAS:KEY=VALUE"),
                          (["--replica-set", "1:gpu=H200", "--prefill-replicas", "1"], "--prefill-set/--decode-set")):
        result = CliRunner().invoke(main, ["replay", str(path), "--replicas", "2", "--out", str(tmp_path / "x")] + args
                                    if "--prefill-replicas" not in args else
                                    ["replay", str(path), "--out", str(tmp_path / "x")] + args)
        assert result.exit_code != 0 and message in result.output, result.output


def test_a_config_file_may_give_the_replica_sets(tmp_path):
    from simkv.traces.schema import write_trace

    path = tmp_path / "t.parquet"
    write_trace(loaded_trace(40, seed=7), path)
    (tmp_path / "f.yaml").write_text("replicas: 2\nmax_model_len: 2048\nreplica_sets:\n  '1':\n    gpu: H200\n"
                                     "    max_num_seqs: 16\n")
    result = CliRunner().invoke(main, ["replay", str(path), "--config", str(tmp_path / "f.yaml"), "--quiet",
                                       "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "r" / "summary.json").read_text())["fleet"]["replicas"]
    assert [(row["gpu"], row["max_num_seqs"]) for row in rows][1] == ("H200", 16)
    (tmp_path / "g.yaml").write_text("replicas: 2\nreplica_sets: [1]\n")
    result = CliRunner().invoke(main, ["replay", str(path), "--config", str(tmp_path / "g.yaml"),
                                       "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "g.yaml: replica_sets must be a mapping" in result.output


def test_a_sweep_may_give_replicas_other_engines(tmp_path):
    """replica_sets as a sweep key: each value one fleet's sets (canonical text), the options'
    commas kept inside a --grid value; the cell replays what `simkv replay --replica-set` does."""
    import pyarrow.parquet as pq

    from simkv.sweep import SweepError, parse_grid
    from simkv.traces.schema import write_trace

    grid = parse_grid(["replica_sets=none,2-3:max_num_seqs=8,gpu=H200,0:gpu=A100-80GB;1-2:gpu=H200"])
    assert grid["replica_sets"] == [None, "2-3:gpu=H200,max_num_seqs=8", "0:gpu=A100-80GB;1-2:gpu=H200"]
    for bad, message in (("replica_sets=2-3", "expected REPLICAS:KEY=VALUE"),
                         ("replica_sets=x:gpu=H200", "expected REPLICAS:KEY=VALUE")):
        with pytest.raises(SweepError, match=message):
            parse_grid([bad])
    path = tmp_path / "t.parquet"
    write_trace(loaded_trace(60, seed=8), path)
    (tmp_path / "f.yaml").write_text("replica_sets:\n  '1':\n    gpu: H200\n")
    out = tmp_path / "s"
    result = CliRunner().invoke(main, ["sweep", str(path), "--config", str(tmp_path / "f.yaml"), "--set", "replicas=2",
                                       "--set", "max_model_len=2048", "--grid", "max_num_seqs=8,32", "--out", str(out),
                                       "--quiet"])
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [row["status"] for row in rows] == ["ok", "ok"]
    for row in rows:
        summary = json.loads((out / "cells" / row["cell_id"] / "summary.json").read_text())
        assert [r["gpu"] for r in summary["fleet"]["replicas"]] == ["H100-SXM", "H200"]
    # the same fleet replayed by hand gives the cell's figures
    alone = CliRunner().invoke(main, ["replay", str(path), "--replicas", "2", "--replica-set", "1:gpu=H200",
                                      "--max-model-len", "2048", "--max-num-seqs", "8", "--out", str(tmp_path / "r"),
                                      "--quiet"])
    assert alone.exit_code == 0, alone.output
    by_hand = json.loads((tmp_path / "r" / "summary.json").read_text())
    cell = json.loads((out / "cells" / rows[0]["cell_id"] / "summary.json").read_text())
    assert cell["ttft_s"] == by_hand["ttft_s"] and cell["fleet"]["replicas"] == by_hand["fleet"]["replicas"]
    # with P/D pools a cell has no one fleet to give sets to
    result = CliRunner().invoke(main, ["sweep", str(path), "--set", "replica_sets=0:gpu=H200", "--set",
                                       "prefill_replicas=1", "--out", str(tmp_path / "pd"), "--quiet"])
    rows = pq.read_table(tmp_path / "pd" / "sweep.parquet").to_pylist()
    assert rows[0]["status"] == "failed" and "two pools, not one fleet" in rows[0]["error"]
