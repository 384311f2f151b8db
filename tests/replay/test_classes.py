"""Request classes in a replay (simkv/replay/classes.py) and SLOs per class (simkv/replay/goodput.py)."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from simkv.config import EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.replay.classes import classes_summary
from simkv.replay.goodput import GoodputError, check_slo_classes, goodput_summary, parse_goodput
from simkv.replay.results import class_itl, dist
from simkv.studies.goodput_search import search_max_rate
from simkv.traces.merge import merge_traces
from simkv.traces.schema import read_trace, take_rows, trace_from_frame, write_trace
from simkv.traces.transform import Edits, transform
from tests.cli_runs import cli_fails, cli_ok

AZURE = "traces/azure_conv_slice.parquet"
LINEAR = {"step_base_s": 0.015, "step_per_token_s": 2e-5}


def mixed(n: int = 150):
    """Azure's first n turns as "chat" beside the next n, twice as long to answer, as "batch"."""
    azure = read_trace(AZURE)
    chat = take_rows(azure, np.arange(n))
    batch = take_rows(azure, np.arange(n, 2 * n))
    batch = replace(batch, arrival_time_s=batch.arrival_time_s - batch.arrival_time_s[0],
                    output_tokens=batch.output_tokens * 2)
    return merge_traces([("chat", chat), ("batch", batch)])


def test_slos_per_class_parse():
    assert parse_goodput(["chat:ttft:500", "ttft:2000", "a:b:tpot:9"]) == {
        "chat:ttft": 500.0, "ttft": 2000.0, "a:b:tpot": 9.0}
    for bad in (":ttft:5", " :ttft:5", "chat:itl:5", "chat:ttft"):
        with pytest.raises(GoodputError, match="CLASS:KEY:MILLISECONDS"):
            parse_goodput([bad])
    with pytest.raises(GoodputError, match="twice"):
        parse_goodput(["chat:ttft:5", "chat:ttft:6"])


def test_a_class_slo_replaces_the_slo_for_all_on_that_class_only():
    requests = pd.DataFrame({
        "request_class": ["chat", "chat", "batch", "batch", "batch"],
        "status": ["finished"] * 4 + ["not_sent"],
        "ttft_s": [0.1, 0.9, 0.9, 5.0, np.nan], "mean_itl_s": [0.01, 0.01, 0.05, 0.01, np.nan],
        "e2e_s": [1.0, 1.0, 9.0, 9.0, np.nan]})
    slo = {"ttft": 500.0, "batch:ttft": 2000.0, "tpot": 20.0}
    g = goodput_summary(requests, slo, duration_s=2.0)
    # chat: ttft 500 ms and tpot; batch: ttft 2 s (not 500 ms) and tpot; the unsent row counts nowhere
    assert g["num_good"] == 1 and g["slo_attainment"] == 0.25
    assert g["attainment_by_class"] == {"chat": 0.5, "batch": 0.0} and g["lowest_class_attainment"] == 0.0
    assert g["attainment_by_slo"] == {"ttft": 0.5, "batch:ttft": 0.5, "tpot": 0.75}
    # without a class SLO each class's attainment is reported and nothing is held per class
    g = goodput_summary(requests, {"ttft": 1000.0}, duration_s=2.0)
    assert g["attainment_by_class"] == {"chat": 1.0, "batch": 0.5} and "lowest_class_attainment" not in g
    with pytest.raises(GoodputError, match="no request class 'bulk' \\(its classes: chat, batch\\)"):
        check_slo_classes({"bulk:ttft": 5.0}, ("request_class", requests["request_class"].to_numpy()), "t.parquet")
    with pytest.raises(GoodputError, match="t.parquet has no request classes"):
        check_slo_classes({"bulk:ttft": 5.0}, None, "t.parquet")


def test_replay_breaks_latencies_down_by_class_recomputably():
    trace = mixed()
    config = EngineConfig.from_flat({"max_num_seqs": 16})
    result = replay(trace, config, "linear", LINEAR, goodput={"ttft": 300.0, "batch:e2el": 60000.0})
    requests, summary = result.requests, result.summary
    assert requests["request_class"].tolist() == trace.request_class.tolist()
    classes = summary["classes"]
    assert classes["by"] == "request_class" and list(classes["classes"]) == ["chat", "batch"]
    assert sum(c["num_requests"] for c in classes["classes"].values()) == len(trace)
    for name, c in classes["classes"].items():
        rows = requests[requests["request_class"] == name]
        assert c["ttft_s"] == dist(rows["ttft_s"].to_numpy())
        assert c["prompt_tokens"] == int(rows["prompt_tokens"].sum())
        assert c["prefix_hit_tokens"] == int(rows["prefix_hit_tokens"].sum())
        assert c["slo_attainment"] == summary["goodput"]["attainment_by_class"][name]
        waited = rows["queue_held_by"].astype(str)
        assert c["queue_held_by"] == {k: int((waited == k).sum()) for k in set(waited) - {"none"}}
    chat, batch = classes["classes"]["chat"], classes["classes"]["batch"]
    assert chat["output_tokens"] + batch["output_tokens"] == int(requests["output_tokens"].sum())
    # the batch class is held to its E2E limit, not to the 300 ms TTFT every chat turn must meet
    ok = requests["status"] == "finished"
    chat_good = ok & (requests["request_class"] == "chat") & (requests["ttft_s"] <= 0.3)
    batch_good = ok & (requests["request_class"] == "batch") & (requests["ttft_s"] <= 0.3) & (requests["e2e_s"] <= 60)
    assert summary["goodput"]["num_good"] == int((chat_good | batch_good).sum())
    assert 0 < chat_good.sum() < len(trace) / 2  # the limit bites
    assert sum(classes["classes"]["chat"]["queue_held_by"].values()) > 0  # (16 sequences: the chat waits on them)


def test_priorities_are_the_classes_of_a_trace_without_labels():
    trace = transform(read_trace(AZURE), Edits(head=120))
    config = EngineConfig.from_flat({"max_num_seqs": 8, "scheduling_policy": "priority"})
    assert "classes" not in replay(trace, config, "linear", LINEAR).summary  # no column: nothing to break down
    one = replace(trace, priority=np.zeros(len(trace), dtype=np.int64))
    assert "classes" not in replay(one, config, "linear", LINEAR).summary  # one priority: nothing either
    two = replace(trace, priority=(np.arange(len(trace)) % 2).astype(np.int64))
    result = replay(two, config, "linear", LINEAR, goodput={"priority=0:ttft": 1e6, "ttft": 1.0})
    classes = result.summary["classes"]
    assert classes["by"] == "priority" and list(classes["classes"]) == ["priority=0", "priority=1"]
    first, second = classes["classes"]["priority=0"], classes["classes"]["priority=1"]
    assert first["ttft_s"]["mean"] < second["ttft_s"]["mean"]  # what priority scheduling is for
    assert first["slo_attainment"] == 1.0 and second["slo_attainment"] == 0.0
    assert result.requests["priority"].tolist() == two.priority.tolist()


def test_fleets_and_disaggregated_pools_break_down_alike():
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = mixed(60)
    config = EngineConfig.from_flat({})
    for kwargs in ({"fleet": FleetSpec(2)}, {"disaggregation": DisaggregationSpec(1, 1)}):
        result = replay(trace, config, "linear", LINEAR, **kwargs)
        got = result.summary["classes"]["classes"]
        assert [c["num_requests"] for c in got.values()] == [60, 60]
        itl = class_itl(result.fleet_runs or [result.run])  # (the token gaps: from the engines, not the table)
        assert got == classes_summary(result.requests, result.summary["duration_s"], itl=itl)["classes"]["classes"]
        assert all(c["itl_s"]["p50"] > 0 for c in got.values())


def test_the_search_holds_every_class_to_the_target():
    trace = mixed(100)
    config = EngineConfig.from_flat({"max_num_seqs": 32})
    whole = search_max_rate(trace, config, {"ttft": 400.0}, target=0.9, tolerance=0.05, cost_model="linear",
                            cost_options=LINEAR)
    # the same limit for chat alone (batch unheld), then for chat while batch must meet an impossible one
    chat_only = search_max_rate(trace, config, {"chat:ttft": 400.0, "e2el": 1e9}, target=0.9, tolerance=0.05,
                                cost_model="linear", cost_options=LINEAR)
    assert chat_only["status"] == "found" and whole["status"] == "found"
    for p in chat_only["probes"]:
        assert p["met"] == (p["slo_attainment"] >= 0.9)
    never = search_max_rate(trace, config, {"chat:ttft": 400.0, "batch:ttft": 0.001}, target=0.5,
                            cost_model="linear", cost_options=LINEAR)
    assert never["status"] == "unattainable"  # half the requests (chat) could meet it; batch never


def test_commands_show_and_check_classes(tmp_path):
    trace = tmp_path / "mix.parquet"
    write_trace(mixed(80), trace)
    out = tmp_path / "r"
    text = cli_ok(["replay", str(trace), "--out", str(out), "--cost-model", "linear", "--goodput", "chat:ttft:300",
                   "--goodput", "tpot:50"])
    assert "per request class" in text and "chat" in text and "SLO %" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["goodput"]["slo_ms"] == {"chat:ttft": 300.0, "tpot": 50.0}
    assert pd.read_parquet(out / "requests.parquet")["request_class"].iloc[0] == "chat"
    html = (out / "report.html").read_text()
    assert "Per request class" in html and "<td>batch</td>" in html
    assert ">chat p99<" in html and ">batch p50<" in html  # TTFT over time, a line per class
    assert "no request class 'bulk' (its classes: chat, batch)" in cli_fails(
        ["replay", str(trace), "--out", str(tmp_path / "x"), "--goodput", "bulk:ttft:300"])
    assert "has no request classes" in cli_fails(
        ["replay", AZURE, "--out", str(tmp_path / "x"), "--goodput", "chat:ttft:300"])
    assert not (tmp_path / "x").exists()  # refused before anything ran
    record = tmp_path / "g"
    cli_ok(["goodput", str(trace), "--goodput", "chat:ttft:300", "--goodput", "batch:e2el:60000", "--cost-model",
            "linear", "--tolerance", "0.1", "--out", str(record)])
    assert "of each request class's requests meet the SLOs" in (record / "goodput.md").read_text()


def test_compare_puts_each_class_side_by_side(tmp_path):
    from simkv.compare.compare import compare_runs

    trace = tmp_path / "mix.parquet"
    write_trace(mixed(60), trace)
    for name, budget in (("a", "8192"), ("b", "1024")):
        cli_ok(["replay", str(trace), "--out", str(tmp_path / name), "--cost-model", "linear",
                "--max-num-batched-tokens", budget, "--quiet"])
    rows = {r["metric"]: r for r in compare_runs(tmp_path / "a", tmp_path / "b")["metrics"]}
    a = json.loads((tmp_path / "a" / "summary.json").read_text())["classes"]["classes"]
    b = json.loads((tmp_path / "b" / "summary.json").read_text())["classes"]["classes"]
    for name in ("chat", "batch"):
        row = rows[f"class.{name}.ttft_s.p99"]
        assert (row["simulated"], row["measured"]) == (a[name]["ttft_s"]["p99"], b[name]["ttft_s"]["p99"])


def test_a_sweep_gives_each_class_its_columns(tmp_path):
    import pyarrow.parquet as pq

    trace = tmp_path / "mix.parquet"
    write_trace(mixed(60), trace)
    out = tmp_path / "sweep"
    cli_ok(["sweep", str(trace), "--grid", "max_num_seqs=4,64", "--set", "cost_model=linear", "--goodput",
            "chat:ttft:300", "--out", str(out)])
    table = pq.read_table(out / "sweep.parquet").to_pylist()
    assert "batch:tpot_p99_s" in table[0] and "chat:slo_attainment" in (out / "sweep.md").read_text()
    for row in table:
        summary = json.loads((out / "cells" / row["cell_id"] / "summary.json").read_text())
        chat = summary["classes"]["classes"]["chat"]
        assert (row["chat:ttft_p99_s"], row["chat:slo_attainment"]) == (chat["ttft_s"]["p99"], chat["slo_attainment"])
    assert table[0]["chat:ttft_p99_s"] > table[1]["chat:ttft_p99_s"]  # 4 sequences at once queue the chat


def test_a_class_may_have_replicas_of_its_own():
    from simkv.replay.router import Router, RouterError, parse_class_replicas

    assert parse_class_replicas(["docs=3", "chat=0-1,2"]) == (("docs", (3,)), ("chat", (0, 1, 2)))
    for bad, message in (("docs", "CLASS=REPLICAS"), ("=3", "CLASS=REPLICAS"), ("docs=a", "not a list"),
                         ("docs=2-x", "not a list")):
        with pytest.raises(RouterError, match=message):
            parse_class_replicas([bad])
    with pytest.raises(RouterError, match="twice"):
        parse_class_replicas(["a=1", "a=2"])
    with pytest.raises(RouterError, match="replica 4 is not one of the fleet's 0-3"):
        Router("round_robin", 4, class_replicas=(("docs", (4,)),))
    router = Router("round_robin", 4, class_replicas=(("docs", (3,)), ("code", (2, 3))))
    picks = [router.choose([0] * 4, None, 0, None, c) for c in ("chat", "docs", "chat", "code", "code", "chat", None)]
    assert picks == [0, 3, 1, 2, 3, 0, 1]  # chat (and no class) take turns over the unclaimed 0 and 1
    every = Router("least_outstanding", 2, class_replicas=(("a", (0,)), ("b", (1,))))
    assert every.candidates("c") == (0, 1)  # every replica claimed: the others go anywhere
    assert every.choose([5, 1], None, 0, None, "a") == 0 and every.choose([5, 1], None, 0, None, "c") == 1


def test_a_fleet_routes_each_class_to_its_replicas(tmp_path):
    trace = mixed(60)
    fleet = FleetSpec(3, "least_outstanding", class_replicas=(("batch", (2,)),))
    result = replay(trace, EngineConfig.from_flat({}), "linear", LINEAR, fleet=fleet)
    requests = result.requests
    batch = requests["request_class"] == "batch"
    assert set(requests.loc[batch, "replica"]) == {2} and set(requests.loc[~batch, "replica"]) == {0, 1}
    assert result.summary["fleet"]["router"]["class_replicas"] == {"batch": [2]}
    with pytest.raises(ValueError, match="no request class 'docs'"):
        replay(trace, EngineConfig.from_flat({}), "linear", LINEAR,
               fleet=FleetSpec(3, class_replicas=(("docs", (2,)),)))
    with pytest.raises(ValueError, match="no request_class column"):
        replay(transform(read_trace(AZURE), Edits(head=20)), EngineConfig.from_flat({}), "linear", LINEAR,
               fleet=FleetSpec(3, class_replicas=(("docs", (2,)),)))
    path = tmp_path / "mix.parquet"
    write_trace(trace, path)
    text = cli_ok(["replay", str(path), "--out", str(tmp_path / "r"), "--replicas", "3", "--class-replicas", "batch=2",
                   "--cost-model", "linear"])
    assert "per request class" in text
    assert "replica 3 is not one of the fleet's 0-2" in cli_fails(
        ["replay", str(path), "--out", str(tmp_path / "x"), "--replicas", "3", "--class-replicas", "batch=3"])
    assert "with P/D pools an item names its pool" in cli_fails(
        ["replay", str(path), "--out", str(tmp_path / "x"), "--prefill-replicas", "1", "--decode-replicas", "1",
         "--class-replicas", "batch=0"])


def test_the_search_record_gives_each_class_s_attainment(tmp_path):
    trace = tmp_path / "mix.parquet"
    write_trace(mixed(60), trace)
    out = tmp_path / "g"
    cli_ok(["goodput", str(trace), "--goodput", "ttft:500", "--cost-model", "linear", "--tolerance", "0.2",
            "--out", str(out), "--quiet"])
    record = json.loads((out / "goodput.json").read_text())
    for p in record["probes"]:
        assert set(p["attainment_by_class"]) == {"chat", "batch"}
        assert p["slo_attainment"] == pytest.approx(  # (no SLO per class: the whole trace's, between the classes')
            (60 * p["attainment_by_class"]["chat"] + 60 * p["attainment_by_class"]["batch"]) / 120)
    assert "% (chat " in (out / "goodput.md").read_text()


def test_a_config_file_may_give_a_class_its_replicas(tmp_path):
    trace = tmp_path / "mix.parquet"
    write_trace(mixed(40), trace)
    (tmp_path / "f.yaml").write_text("replicas: 3\nclass_replicas:\n  batch: [1, 2]\n")
    cli_ok(["replay", str(trace), "--config", str(tmp_path / "f.yaml"), "--out", str(tmp_path / "r"), "--quiet",
            "--cost-model", "linear"])
    requests = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    assert set(requests.loc[requests["request_class"] == "batch", "replica"]) <= {1, 2}
    assert set(requests.loc[requests["request_class"] == "chat", "replica"]) == {0}
    (tmp_path / "g.yaml").write_text("replicas: 3\nclass_replicas:\n  batch: 7\n")
    assert "g.yaml: --class-replicas batch: replica 7" in cli_fails(
        ["replay", str(trace), "--config", str(tmp_path / "g.yaml"), "--out", str(tmp_path / "x")])


def test_under_parallel_sampling_each_sequence_queries_the_prompt():
    trace = replace(mixed(30), n=np.full(60, 2, dtype=np.int64))
    result = replay(trace, EngineConfig.from_flat({}), "linear", LINEAR)
    requests, summary = result.requests, result.summary
    assert requests["n"].tolist() == [2] * 60
    queried = sum(c["prompt_tokens"] * 2 for c in summary["classes"]["classes"].values())
    hits = sum(c["prefix_hit_tokens"] for c in summary["classes"]["classes"].values())
    assert queried == summary["prefix_cache_queries_tokens"] and hits == summary["prefix_cache_hits_tokens"]
    for c in summary["classes"]["classes"].values():  # (the second sample of every prompt hits the first's blocks)
        assert 0.4 < c["prefix_hit_share"] == c["prefix_hit_tokens"] / (2 * c["prompt_tokens"]) <= 0.5


def test_a_sweep_may_give_a_class_replicas_of_its_own(tmp_path):
    import pyarrow.parquet as pq

    from simkv.sweep import SweepError
    from simkv.sweep.grid import class_replicas_text

    assert class_replicas_text("batch=1-2;chat=0", "--grid") == "batch=1,2;chat=0"
    assert class_replicas_text({"batch": [2, 1], "chat": 0}, "--config") == "batch=1,2;chat=0"
    assert class_replicas_text("none", "--grid") is None
    with pytest.raises(SweepError, match="--set: class_replicas: 'batch': expected CLASS=REPLICAS"):
        class_replicas_text("batch", "--set")
    trace = tmp_path / "mix.parquet"
    write_trace(mixed(40), trace)
    out = tmp_path / "sweep"
    cli_ok(["sweep", str(trace), "--set", "replicas=3", "--set", "cost_model=linear", "--grid",
            "class_replicas=none,batch=2,batch=1-2", "--out", str(out), "--quiet"])
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [r["class_replicas"] for r in rows] == [None, "batch=2", "batch=1,2"]
    served = []  # (round robin: 40 chat and 40 batch requests; a class with replicas takes turns over its own)
    for row in rows:
        fleet = json.loads((out / "cells" / row["cell_id"] / "summary.json").read_text())["fleet"]
        served.append(([r["num_requests"] for r in fleet["replicas"]], fleet["router"].get("class_replicas")))
    assert served == [([27, 27, 26], None), ([20, 20, 40], {"batch": [2]}), ([40, 20, 20], {"batch": [1, 2]})]
    (tmp_path / "c.yaml").write_text("replicas: 2\nclass_replicas:\n  chat: 0\n")
    cli_ok(["sweep", str(trace), "--config", str(tmp_path / "c.yaml"), "--set", "cost_model=linear",
            "--out", str(tmp_path / "s2"), "--quiet"])
    row = pq.read_table(tmp_path / "s2" / "sweep.parquet").to_pylist()[0]
    fleet = json.loads((tmp_path / "s2" / "cells" / row["cell_id"] / "summary.json").read_text())["fleet"]
    assert fleet["router"]["class_replicas"] == {"chat": [0]} and fleet["replicas"][1]["num_requests"] == 40
    assert "has no request class 'docs' (its classes: chat, batch)" in cli_fails(
        ["sweep", str(trace), "--set", "class_replicas=docs=1", "--out", str(tmp_path / "s3")])
    plain = tmp_path / "plain.parquet"
    write_trace(transform(read_trace(AZURE), Edits(head=20)), plain)
    assert "has no request_class column" in cli_fails(
        ["sweep", str(plain), "--set", "class_replicas=docs=1", "--out", str(tmp_path / "s4")])
    failed = cli_fails(["sweep", str(trace), "--set", "class_replicas=batch=0", "--set", "prefill_replicas=1",
                        "--set", "cost_model=linear", "--out", str(tmp_path / "s5")])
    assert "with P/D pools an item names its pool" in failed
    cli_ok(["sweep", str(trace), "--set", "class_replicas=prefill:batch=1", "--set", "prefill_replicas=2",
            "--set", "cost_model=linear", "--out", str(tmp_path / "s6"), "--quiet"])
    row = pq.read_table(tmp_path / "s6" / "sweep.parquet").to_pylist()[0]
    pd_section = json.loads((tmp_path / "s6" / "cells" / row["cell_id"] / "summary.json").read_text())["disaggregation"]
    assert pd_section["prefill"]["router"]["class_replicas"] == {"batch": [1]}


def chat_and_long_prompts(n: int = 120, seed: int = 3):
    """Short chat prompts beside long ones ("docs"), arriving together over 6 s."""
    rng = np.random.default_rng(seed)
    long_ = rng.random(n) < 0.4
    return trace_from_frame(pd.DataFrame({
        "request_id": [f"r{i}" for i in range(n)], "arrival_time_s": np.sort(rng.uniform(0, 6, n)),
        "prompt_tokens": np.where(long_, rng.integers(1500, 3000, n), rng.integers(20, 100, n)),
        "output_tokens": rng.integers(20, 200, n), "request_class": np.where(long_, "docs", "chat")}))


QWEN3_NEXT = {"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 2, "max_num_batched_tokens": 512}


@pytest.mark.parametrize("options, fleet", [
    ({}, None),
    ({"max_model_len": 4096, "num_gpu_blocks": 500, "max_num_batched_tokens": 512}, None),  # (preemptions)
    (QWEN3_NEXT, None),  # (aligned chunks leave decoders out of steps: their gaps span the steps missed)
    (QWEN3_NEXT | {"async_scheduling": True}, None),
    ({"pipeline_parallel_size": 2}, None),
    ({"speculative_method": "ngram", "num_speculative_tokens": 3}, None),
    ({}, FleetSpec(2, "least_outstanding")),
    ({}, "pd"),  # (the decode pool's gaps: a request's first token comes from its prefill)
    ({"model": "qwen3-30b-a3b", "data_parallel_size": 2}, None),  # (DP ranks: the roofline only)
], ids=["plain", "preempting", "qwen3-next", "qwen3-next-async", "pp2", "ngram", "fleet", "pd", "dp2"])
def test_each_class_gets_its_token_level_itl(options, fleet):
    from simkv.replay.disaggregated import DisaggregationSpec
    from simkv.replay.results import class_itl_samples, itl_samples, token_gap_table, weighted_dist

    pools = {"disaggregation": DisaggregationSpec(1, 1)} if fleet == "pd" else {"fleet": fleet}
    cost = ("roofline", None) if "data_parallel_size" in options else ("linear", LINEAR)
    result = replay(chat_and_long_prompts(), EngineConfig.from_flat(options), *cost, **pools)
    runs = result.fleet_runs or [result.run]
    for run in runs:  # each step's gaps, split by class, add up to the step's
        np.testing.assert_array_equal(run.steps.class_decode_tokens().sum(axis=1),
                                      run.steps.columns()["num_decode_tokens"])
    requests = result.requests
    per_class = class_itl_samples(runs)
    assert list(per_class) == ["chat", "docs"]
    total_time = total_gaps = 0.0
    for name, (values, weights) in per_class.items():
        done = requests[(requests["request_class"] == name) & (requests["status"] == "finished")]
        # the class's gaps cover exactly the time from each request's first token to its last
        span = (done["finish_time_s"] - done["first_token_time_s"]).sum()
        assert float(values @ weights) == pytest.approx(span, rel=1e-9)
        if "speculative_method" not in options:  # (a verify step's accepted tokens arrive at once: one gap)
            assert weights.sum() == (done["output_tokens"] - 1).sum()
        assert result.summary["classes"]["classes"][name]["itl_s"] == weighted_dist(values, weights)
        total_time, total_gaps = total_time + float(values @ weights), total_gaps + weights.sum()
    every = [itl_samples(run) for run in runs]
    assert total_time == pytest.approx(sum(float(v @ w) for v, w in every), rel=1e-12)
    assert total_gaps == sum(w.sum() for _, w in every)
    assert result.summary["itl_s"]["mean"] == pytest.approx(total_time / total_gaps, rel=1e-9)
    if options.get("model") == QWEN3_NEXT["model"]:
        assert runs[0].scheduler.resumed_steps  # (the case has decoders left out of steps)
    table = token_gap_table(runs)  # (token_gaps.parquet: the same samples, class by class)
    for name in per_class:
        rows = table[table["class"] == name]
        assert weighted_dist(rows["itl_s"].to_numpy(), rows["tokens"].to_numpy()) == \
            result.summary["classes"]["classes"][name]["itl_s"]
    whole = weighted_dist(table["itl_s"].to_numpy(), table["tokens"].to_numpy())
    assert {k: v for k, v in whole.items() if k != "mean"} == \
        {k: v for k, v in result.summary["itl_s"].items() if k != "mean"}
    assert whole["mean"] == pytest.approx(result.summary["itl_s"]["mean"], rel=1e-12)


def test_class_itl_reaches_the_tables(tmp_path):
    trace = tmp_path / "mix.parquet"
    write_trace(chat_and_long_prompts(60), trace)
    text = cli_ok(["replay", str(trace), "--out", str(tmp_path / "r"), "--cost-model", "linear"])
    assert "ITL" in text.split("per request class")[1]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    itl = summary["classes"]["classes"]["chat"]["itl_s"]
    assert f"{1e3 * itl['p99']:.1f}" in text.split("per request class")[1]
    assert "ITL p50 / p99 (ms)" in (tmp_path / "r" / "report.html").read_text()
    cli_ok(["sweep", str(trace), "--grid", "max_num_seqs=4,64", "--set", "cost_model=linear", "--out",
            str(tmp_path / "s"), "--quiet"])
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    assert all(row["chat:itl_p99_s"] > 0 and row["docs:itl_p99_s"] > 0 for row in rows)


def test_data_parallel_ranks_behind_a_router_may_give_a_class_its_ranks(tmp_path):
    trace = mixed(40)
    config = EngineConfig.from_flat({"model": "qwen3-30b-a3b", "data_parallel_size": 2})
    result = replay(trace, config, fleet=FleetSpec(1, "least_outstanding", class_replicas=(("batch", (1,)),)))
    requests = result.requests
    batch = requests["request_class"] == "batch"
    assert set(requests.loc[batch, "replica"]) == {1} and set(requests.loc[~batch, "replica"]) == {0}
    assert result.summary["data_parallel"]["router"]["class_replicas"] == {"batch": [1]}
    with pytest.raises(ValueError, match="vLLM's own DP balancer picks ranks by load"):
        replay(trace, config, fleet=FleetSpec(1, class_replicas=(("batch", (1,)),)))
    with pytest.raises(ValueError, match="replica 2 is not one of the fleet's 0-1"):
        replay(trace, config, fleet=FleetSpec(1, "round_robin", class_replicas=(("batch", (2,)),)))
    with pytest.raises(ValueError, match="one engine has no replicas to give a class"):
        replay(trace, EngineConfig.from_flat({}), "linear", LINEAR, fleet=FleetSpec(1, class_replicas=(("batch", (0,)),)))


def test_each_pd_pool_may_give_a_class_replicas_of_its_own(tmp_path):
    from simkv.config import ConfigError
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = mixed(40)
    spec = DisaggregationSpec(2, 2, prefill_class_replicas=(("batch", (1,)),), decode_class_replicas=(("chat", (0,)),))
    result = replay(trace, EngineConfig.from_flat({}), "linear", LINEAR, disaggregation=spec)
    requests = result.requests
    batch = requests["request_class"] == "batch"
    assert set(requests.loc[batch, "prefill_replica"]) == {1} and set(requests.loc[~batch, "prefill_replica"]) == {0}
    assert set(requests.loc[~batch, "decode_replica"]) == {0} and set(requests.loc[batch, "decode_replica"]) == {1}
    section = result.summary["disaggregation"]
    assert section["prefill"]["router"]["class_replicas"] == {"batch": [1]}
    assert section["prefill_class_replicas"] == {"batch": [1]} and section["decode_class_replicas"] == {"chat": [0]}
    with pytest.raises(ConfigError, match="decode pool: --class-replicas chat: replica 2 is not one of the fleet's 0-1"):
        DisaggregationSpec(2, 2, decode_class_replicas=(("chat", (2,)),))
    with pytest.raises(ValueError, match="no request class 'docs'"):
        replay(trace, EngineConfig.from_flat({}), "linear", LINEAR,
               disaggregation=DisaggregationSpec(2, 1, prefill_class_replicas=(("docs", (1,)),)))
    path = tmp_path / "mix.parquet"
    write_trace(trace, path)
    cli_ok(["replay", str(path), "--prefill-replicas", "2", "--class-replicas", "prefill:batch=1", "--cost-model",
            "linear", "--out", str(tmp_path / "r"), "--quiet"])
    requests = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    assert set(requests.loc[requests["request_class"] == "batch", "prefill_replica"]) == {1}
    (tmp_path / "c.yaml").write_text("class_replicas:\n  prefill:batch: 1\n")
    cli_ok(["replay", str(path), "--prefill-replicas", "2", "--config", str(tmp_path / "c.yaml"), "--cost-model",
            "linear", "--out", str(tmp_path / "r2"), "--quiet"])
    requests = pd.read_parquet(tmp_path / "r2" / "requests.parquet")
    assert set(requests.loc[requests["request_class"] == "batch", "prefill_replica"]) == {1}
    out = tmp_path / "g"
    cli_ok(["goodput", str(path), "--prefill-replicas", "2", "--class-replicas", "prefill:batch=1", "--goodput",
            "ttft:500", "--cost-model", "linear", "--tolerance", "0.3", "--out", str(out), "--quiet"])
    record = json.loads((out / "goodput.json").read_text())
    assert record["disaggregation"]["prefill_class_replicas"] == {"batch": [1]}


def test_requests_may_be_classed_by_their_size(tmp_path):
    from simkv.traces.errors import TraceError
    from simkv.traces.transform import parse_class_bins

    azure = read_trace(AZURE)
    bins = parse_class_bins("short<1024, medium<4096, long", "--class-by-prompt-tokens")
    assert bins == ((("short", 1024), ("medium", 4096)), "long")
    sized = transform(azure, Edits(class_by=("prompt_tokens", *bins)))
    prompt = azure.prompt_tokens
    expected = np.where(prompt < 1024, "short", np.where(prompt < 4096, "medium", "long"))
    assert sized.request_class.tolist() == expected.tolist() and {"short", "medium", "long"} == set(expected)
    by_reply = transform(azure, Edits(class_by=("output_tokens", (("brief", 64),), "long")))
    assert by_reply.request_class.tolist() == np.where(azure.output_tokens < 64, "brief", "long").tolist()
    for bad, message in (("long", "two classes or more"), ("a<0,b", "not CLASS<TOKENS"), ("a<x,b", "not CLASS<TOKENS"),
                         ("a<10,b<10,c", "the bounds must increase"), ("a<10,b<20", "the last class takes the rest"),
                         ("a<10,a", "named twice")):
        with pytest.raises(TraceError, match=message):
            parse_class_bins(bad, "--class-by-prompt-tokens")
    with pytest.raises(TraceError, match="give one"):
        transform(azure, Edits(request_class="chat", class_by=("prompt_tokens", *bins)))
    out = tmp_path / "sized.parquet"
    cli_ok(["trace", "transform", AZURE, "--class-by-prompt-tokens", "short<1024,long", "--out", str(out)])
    assert read_trace(out).request_class.tolist() == np.where(prompt < 1024, "short", "long").tolist()
    assert "not both" in cli_fails(["trace", "transform", AZURE, "--class-by-prompt-tokens", "a<9,b",
                                    "--class-by-output-tokens", "a<9,b", "--out", str(out)])
