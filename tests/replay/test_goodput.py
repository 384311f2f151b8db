"""Goodput under latency SLOs (simkv/replay/goodput.py) and the highest rate that keeps them
(simkv/studies/goodput_search.py, `simkv goodput`)."""
import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.replay.goodput import GoodputError, goodput_summary, good_requests, parse_goodput
from simkv.studies.goodput_search import GoodputSearchError, replicas_for, search_max_rate, trace_rate
from simkv.traces.schema import read_trace
from simkv.traces.transform import Edits, transform

AZURE = "traces/azure_conv_slice.parquet"
LINEAR = {"step_base_s": 0.015, "step_per_token_s": 2e-5}


def test_slos_parse_as_vllm_writes_them():
    assert parse_goodput(["ttft:2000", "TPOT:100"]) == {"ttft": 2000.0, "tpot": 100.0}
    assert parse_goodput(["ttft:2000,e2el:30000"]) == {"ttft": 2000.0, "e2el": 30000.0}
    assert parse_goodput([]) == {}
    for bad, message in [("ttfx:5", "KEY one of ttft, tpot, e2el"), ("ttft", "expected KEY:MILLISECONDS"),
                         ("ttft:fast", "'fast' is not a number"), ("tpot:0", "positive"), ("tpot:-3", "positive")]:
        with pytest.raises(GoodputError, match=message):
            parse_goodput([bad])
    with pytest.raises(GoodputError, match="names 'ttft' twice"):
        parse_goodput(["ttft:1", "ttft:2"])


def test_a_request_is_good_when_finished_and_within_every_limit():
    requests = pd.DataFrame({
        "status": ["finished", "finished", "finished", "finished", "rejected"],
        "ttft_s": [0.5, 2.0, 0.1, 3.0, np.nan],
        "mean_itl_s": [0.05, 0.01, np.nan, 0.01, np.nan],  # the third answered with one token
        "e2e_s": [5.0, 4.0, 0.1, 9.0, np.nan],
    })
    good, each = good_requests(requests, {"ttft": 2000.0, "tpot": 40.0})
    assert good.tolist() == [False, True, True, False, False]  # 2.0 s is within a 2000 ms limit
    assert each["ttft"].tolist() == [True, True, True, False, False]
    assert each["tpot"].tolist() == [False, True, True, True, False]
    g = goodput_summary(requests, {"ttft": 2000.0, "tpot": 40.0}, duration_s=4.0)
    assert g["num_good"] == 2 and g["slo_attainment"] == 0.4 and g["request_goodput_req_s"] == 0.5
    assert g["attainment_by_slo"] == {"ttft": 0.6, "tpot": 0.6}


def test_replay_records_goodput_recomputable_from_its_requests(tmp_path):
    out = tmp_path / "r"
    trace = tmp_path / "head.parquet"
    r = CliRunner().invoke(main, ["trace", "transform", AZURE, "--head", "200", "--out", str(trace)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["replay", str(trace), "--out", str(out), "--goodput", "ttft:150", "--goodput", "tpot:12"])
    assert r.exit_code == 0, r.output
    assert "goodput" in r.output and "150 ms" in r.output  # the terminal table's row
    summary = json.loads((out / "summary.json").read_text())
    requests = pd.read_parquet(out / "requests.parquet")
    g = summary["goodput"]
    ttft_ok = requests["ttft_s"] <= 0.150
    tpot_ok = requests["mean_itl_s"].fillna(0) <= 0.012
    expected = int(((requests["status"] == "finished") & ttft_ok & tpot_ok).sum())
    assert g["num_good"] == expected and 0 < expected < len(requests)  # the limits bite, but not on all
    assert g["request_goodput_req_s"] == pytest.approx(expected / summary["duration_s"])
    assert "goodput (ttft &lt;= 150 ms, tpot &lt;= 12 ms)" in (out / "report.html").read_text()
    r = CliRunner().invoke(main, ["replay", str(trace), "--out", str(out), "--goodput", "itl:5"])
    assert r.exit_code != 0 and "--goodput 'itl:5'" in r.output


def _head(n=300):
    return transform(read_trace(AZURE), Edits(head=n))


def test_the_search_brackets_the_highest_rate_that_meets_the_target():
    trace, config = _head(), EngineConfig.from_flat({"max_num_seqs": 32})
    slo = {"ttft": 1000.0, "tpot": 40.0}
    record = search_max_rate(trace, config, slo, target=0.95, tolerance=0.05, cost_model="linear", cost_options=LINEAR)
    assert record["status"] == "found"
    lo, hi = record["bracket_factors"]
    assert lo < hi <= lo * 1.05
    probes = {p["factor"]: p for p in record["probes"]}
    assert probes[lo]["met"] and probes[lo]["slo_attainment"] >= 0.95
    assert not probes[hi]["met"] and probes[hi]["slo_attainment"] < 0.95
    assert record["max_rate_req_s"] == pytest.approx(trace_rate(trace) * lo)
    assert probes[lo]["rate_req_s"] == pytest.approx(record["max_rate_req_s"])
    # the same inputs give the same search, probe for probe
    again = search_max_rate(trace, config, slo, target=0.95, tolerance=0.05, cost_model="linear", cost_options=LINEAR)
    assert again == record
    # a bigger engine (more sequences at once) sustains a higher rate on the same SLOs
    bigger = search_max_rate(trace, EngineConfig.from_flat({"max_num_seqs": 128}), slo, target=0.95, tolerance=0.05,
                             cost_model="linear", cost_options=LINEAR)
    assert bigger["max_rate_req_s"] > record["max_rate_req_s"]
    # each probe names what held its queue: with 32 sequences, past the rate it is max_num_seqs
    assert probes[hi]["waiting_held_by"].startswith("max_num_seqs ")


def test_limits_no_load_can_meet_or_miss_are_reported_as_such():
    trace, config = _head(60), EngineConfig.from_flat({})
    never = search_max_rate(trace, config, {"ttft": 0.001}, cost_model="linear", cost_options=LINEAR)
    assert never["status"] == "unattainable" and never["max_rate_req_s"] is None
    assert not any(p["met"] for p in never["probes"])
    always = search_max_rate(trace, config, {"e2el": 1e9}, cost_model="linear", cost_options=LINEAR)
    assert always["status"] == "unbounded" and always["bracket_factors"][1] is None
    assert all(p["met"] for p in always["probes"]) and always["max_rate_req_s"] == pytest.approx(
        trace_rate(trace) * 4096)


def test_rejected_requests_that_cap_the_attainment_stop_the_search_with_the_reason():
    """Prompts at or past max_model_len are rejected and meet no SLO at any rate: where they leave
    fewer than the target's share, the search says so after its first probe instead of slowing
    the trace down to nothing."""
    trace = _head(60)
    config = EngineConfig.from_flat({"max_model_len": int(np.percentile(trace.prompt_tokens, 90))})
    record = search_max_rate(trace, config, {"e2el": 1e9}, target=0.95, cost_model="linear", cost_options=LINEAR)
    rejected = int((np.asarray(trace.prompt_tokens) >= config.max_model_len).sum())
    assert rejected > 3 and record["status"] == "unattainable" and len(record["probes"]) == 1
    assert record["num_rejected"] == rejected and f"{rejected} of 60 requests are rejected" in record["reason"]
    loose = search_max_rate(trace, config, {"e2el": 1e9}, target=0.8, cost_model="linear", cost_options=LINEAR)
    assert loose["status"] == "unbounded"  # (the rest meet it: the cap is below the target no more)


def test_a_search_never_slows_a_trace_past_simkv_s_clock():
    """A trace spanning a day, missed at every rate: halving stops where the slowed trace would
    outlast the clock's 48.5 days (a factor of 1/16 here, not 1/4096)."""
    from simkv.studies.goodput_search import lowest_factor

    trace = _head(20)
    day = replace(trace, arrival_time_s=np.linspace(0.0, 86400.0, len(trace)))
    assert lowest_factor(day) == pytest.approx(86400 / 2 ** 21)  # (half the clock: 2^62 ticks of 2^-40 s)
    record = search_max_rate(day, EngineConfig.from_flat({}), {"ttft": 0.001}, cost_model="linear",
                             cost_options=LINEAR)
    assert record["status"] == "unattainable"
    assert min(p["factor"] for p in record["probes"]) == 1 / 16


def test_bad_searches_are_refused_with_the_reason():
    trace, config = _head(20), EngineConfig.from_flat({})
    with pytest.raises(GoodputSearchError, match="at least one SLO"):
        search_max_rate(trace, config, {})
    with pytest.raises(GoodputSearchError, match="--attainment must be in"):
        search_max_rate(trace, config, {"ttft": 100.0}, target=1.5)
    with pytest.raises(GoodputSearchError, match="same instant"):
        search_max_rate(read_trace("traces/req400.parquet"), config, {"ttft": 100.0})
    assert replicas_for(50, 20.787) == 3 and replicas_for(40, 20) == 2 and replicas_for(1, 20) == 1


def test_goodput_command_writes_its_record_and_the_replicas(tmp_path):
    trace = tmp_path / "head.parquet"
    assert CliRunner().invoke(main, ["trace", "transform", AZURE, "--head", "300", "--out", str(trace)]).exit_code == 0
    out = tmp_path / "g"
    r = CliRunner().invoke(main, ["goodput", str(trace), "--goodput", "ttft:1000", "--goodput", "tpot:40",
                                  "--max-num-seqs", "32", "--cost-model", "linear", "--attainment", "0.95",
                                  "--tolerance", "0.05", "--target-rate", "40", "--out", str(out)])
    assert r.exit_code == 0, r.output
    record = json.loads((out / "goodput.json").read_text())
    direct = search_max_rate(read_trace(str(trace)), EngineConfig.from_flat({"max_num_seqs": 32}),
                             {"ttft": 1000.0, "tpot": 40.0}, target=0.95, tolerance=0.05, cost_model="linear",
                             cost_options=LINEAR)
    assert record["max_rate_req_s"] == pytest.approx(direct["max_rate_req_s"])
    assert record["replicas"] == replicas_for(40, direct["max_rate_req_s"]) and record["config"]["max_num_seqs"] == 32
    check = record["fleet_check"]  # the even spread's count replayed as a fleet, then up or down
    assert check["even_spread_replicas"] == record["replicas"] and check["probes"][0]["replicas"] == record["replicas"]
    met = {p["replicas"]: p["met"] for p in check["probes"]}
    assert met[check["replicas"]] and all(not ok for n, ok in met.items() if n < check["replicas"])
    md = (out / "goodput.md").read_text()
    assert f"{record['replicas']} replicas" in md and "Highest rate meeting the target" in md
    assert f"**{check['replicas']} replicas meet the target at 40 req/s" in md
    r = CliRunner().invoke(main, ["goodput", str(trace), "--goodput", "ttft"])
    assert r.exit_code == 2 and "expected KEY:MILLISECONDS" in r.output


def test_a_grid_search_finds_each_combinations_rate_and_the_best(tmp_path):
    from simkv.studies.goodput_search import search_grid

    trace = tmp_path / "head.parquet"
    assert CliRunner().invoke(main, ["trace", "transform", AZURE, "--head", "300", "--out", str(trace)]).exit_code == 0
    slo = {"ttft": 1000.0, "tpot": 40.0}
    grid = {"max_num_seqs": [16, 64], "block_size": [16, 0]}  # block size 0 is refused: that cell fails
    kwargs = dict(target=0.95, tolerance=0.05, cost_model="linear", cost_options=LINEAR)
    record = search_grid(str(trace), {}, grid, slo, **kwargs)
    cells = record["cells"]
    assert [c["swept"] for c in cells] == [{"max_num_seqs": s, "block_size": b} for s in (16, 64) for b in (16, 0)]
    assert [c["status"] for c in cells] == ["found", "failed", "found", "failed"] and "block_size" in cells[1]["error"]
    for c in (cells[0], cells[2]):
        direct = search_max_rate(read_trace(str(trace)), EngineConfig.from_flat(dict(c["swept"], block_size=16)), slo,
                                 **kwargs)
        assert c["max_rate_req_s"] == direct["max_rate_req_s"] and c["num_probes"] == len(direct["probes"])
        assert c["at_max"]["met"] and c["at_max"]["rate_req_s"] == pytest.approx(c["max_rate_req_s"])
    assert record["best_index"] == max((cells[0], cells[2]), key=lambda c: c["max_rate_req_s"])["index"]
    assert search_grid(str(trace), {}, grid, slo, workers=2, **kwargs) == record  # processes change nothing
    r = CliRunner().invoke(main, ["goodput", str(trace), "--goodput", "ttft:1000", "--goodput", "tpot:40",
                                  "--cost-model", "linear", "--attainment", "0.95", "--tolerance", "0.05",
                                  "--grid", "max_num_seqs=16,64", "--target-rate", "20", "--out", str(tmp_path / "g")])
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "g" / "goodput.json").read_text())
    assert [c["max_rate_req_s"] for c in saved["cells"]] == [cells[0]["max_rate_req_s"], cells[2]["max_rate_req_s"]]
    assert [c["replicas"] for c in saved["cells"]] == [replicas_for(20, c["max_rate_req_s"]) for c in saved["cells"]]
    assert "**Best: max_num_seqs=" in (tmp_path / "g" / "goodput.md").read_text()
    r = CliRunner().invoke(main, ["goodput", str(trace), "--goodput", "ttft:1000", "--grid", "max_seqs=1,2"])
    assert r.exit_code == 2 and "unknown option 'max_seqs'" in r.output


def test_a_grid_search_says_the_block_size_a_hybrid_engine_ran_with(tmp_path):
    # vLLM grows a hybrid model's block size until an attention page holds a Mamba state: on
    # Qwen3-Next every block size asked for runs as the same engine, and the table says so
    from simkv.cli.goodput_cmd import grid_markdown
    from simkv.studies.goodput_search import search_grid

    trace = tmp_path / "head.parquet"
    assert CliRunner().invoke(main, ["trace", "transform", AZURE, "--head", "200", "--out", str(trace)]).exit_code == 0
    base = {"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 4}
    kwargs = dict(target=0.95, tolerance=0.1, cost_model="linear", cost_options=LINEAR)
    record = search_grid(str(trace), base, {"block_size": [16, 64]}, {"tpot": 40.0}, **kwargs)
    cells = record["cells"]
    grown = EngineConfig.from_flat(base).cache.block_size
    assert grown > 64 and [(c["asked_block_size"], c["engine_block_size"]) for c in cells] == [(16, grown), (64, grown)]
    assert cells[0]["max_rate_req_s"] == cells[1]["max_rate_req_s"]
    md = grid_markdown(record | {"trace": str(trace), "cost_model": "linear"})
    assert "| block_size | engine block size | max rate" in md and f"| 16 | {grown} | " in md
    plain = search_grid(str(trace), {}, {"block_size": [16, 32]}, {"tpot": 40.0}, **kwargs)
    assert "engine block size" not in grid_markdown(plain | {"trace": str(trace), "cost_model": "linear"})


def test_fleets_sustain_about_their_replicas_times_one_engines_rate():
    from simkv.replay.api import FleetSpec
    from simkv.studies.goodput_search import check_replicas

    trace, config = _head(), EngineConfig.from_flat({"max_num_seqs": 32})
    slo = {"ttft": 1000.0, "tpot": 40.0}
    kwargs = dict(target=0.95, tolerance=0.05, cost_model="linear", cost_options=LINEAR)
    one = search_max_rate(trace, config, slo, **kwargs)["max_rate_req_s"]
    two = search_max_rate(trace, config, slo, fleet=FleetSpec(2, "least_outstanding"), **kwargs)["max_rate_req_s"]
    # a little over twice is possible: on a finite trace at twice the rate an overload lasts half as long
    assert 1.6 * one < two < 3.0 * one
    # at twice one engine's rate, one replica is not enough and the check climbs until a fleet meets it
    kwargs.pop("tolerance")
    check = check_replicas(trace, config, slo, 2 * one, 1, router="least_outstanding", **kwargs)
    counts = [p["replicas"] for p in check["probes"]]
    assert counts[0] == 1 and not check["probes"][0]["met"]
    assert check["replicas"] == counts[-1] >= 2 and check["probes"][-1]["met"]
    none = check_replicas(trace, config, slo, 50 * one, 1, max_replicas=3, **kwargs)
    assert none["replicas"] is None and [p["replicas"] for p in none["probes"]] == [1, 2, 3]
    # from an estimate that is too high, the check goes down to the fewest that still meet it
    down = check_replicas(trace, config, slo, 2 * one, check["replicas"] + 2, router="least_outstanding", **kwargs)
    assert down["replicas"] == check["replicas"] and [p["replicas"] for p in down["probes"]] == \
        list(range(check["replicas"] + 2, check["replicas"] - 2, -1))[:len(down["probes"])]
    assert not down["probes"][-1]["met"] and down["probes"][-1]["replicas"] == check["replicas"] - 1


def test_a_grid_search_of_a_fleet_searches_each_combinations_fleet(tmp_path):
    from simkv.replay.api import FleetSpec
    from simkv.studies.goodput_search import search_grid

    trace = tmp_path / "head.parquet"
    assert CliRunner().invoke(main, ["trace", "transform", AZURE, "--head", "200", "--out", str(trace)]).exit_code == 0
    slo, fleet = {"ttft": 1000.0, "tpot": 40.0}, FleetSpec(2, "least_outstanding")
    kwargs = dict(target=0.95, tolerance=0.05, cost_model="linear", cost_options=LINEAR)
    record = search_grid(str(trace), {}, {"max_num_seqs": [16, 64]}, slo, fleet=fleet, **kwargs)
    for cell in record["cells"]:
        direct = search_max_rate(read_trace(str(trace)), EngineConfig.from_flat(cell["swept"]), slo, fleet=fleet, **kwargs)
        alone = search_max_rate(read_trace(str(trace)), EngineConfig.from_flat(cell["swept"]), slo, **kwargs)
        assert cell["max_rate_req_s"] == direct["max_rate_req_s"] > alone["max_rate_req_s"]


def test_a_grid_may_sweep_the_fleet_itself(tmp_path):
    from simkv.replay.api import FleetSpec
    from simkv.studies.goodput_search import search_grid

    trace = tmp_path / "head.parquet"
    assert CliRunner().invoke(main, ["trace", "transform", AZURE, "--head", "200", "--out", str(trace)]).exit_code == 0
    slo = {"ttft": 1000.0, "tpot": 40.0}
    kwargs = dict(target=0.95, tolerance=0.05, cost_model="linear", cost_options=LINEAR)
    # the command's fleet (3 replicas, least_outstanding) under each cell's own replica count
    record = search_grid(str(trace), {"max_num_seqs": 16}, {"replicas": [1, 2]}, slo,
                         fleet=FleetSpec(3, "least_outstanding"), **kwargs)
    config = EngineConfig.from_flat({"max_num_seqs": 16})
    for cell, n in zip(record["cells"], (1, 2)):
        direct = search_max_rate(read_trace(str(trace)), config, slo, fleet=FleetSpec(n, "least_outstanding"), **kwargs)
        assert cell["status"] == "found" and cell["num_replicas"] == n
        assert cell["max_rate_req_s"] == direct["max_rate_req_s"]
    bad = search_grid(str(trace), {}, {"replicas": [0]}, slo, **kwargs)
    assert bad["cells"][0]["status"] == "failed" and "replicas" in bad["cells"][0]["error"]


def _chat(sessions: int = 60):
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    return multi_turn(SessionShape(sessions=sessions, turns=4, think_time_s=0.0), seed=3)


def test_the_clients_search_brackets_the_most_clients_that_meet_the_target():
    """A closed loop (`--clients`): each probe replays the trace with N clients, one conversation
    each; the found N met the target and N + 1 (or the bracket's other end) missed it."""
    from simkv.studies.goodput_search import client_options, search_max_clients

    trace = _chat()
    config = EngineConfig.from_flat(dict(model="llama-3.1-8b", gpu="A100-80GB"))
    record = search_max_clients(trace, config, {"ttft": 300}, target=0.95, tolerance=0.01)
    assert record["status"] == "found"
    lo, hi = record["bracket_clients"]
    assert hi == lo + 1 and record["max_clients"] == lo and 1 < lo < 60
    by_clients = {p["clients"]: p for p in record["probes"]}
    assert by_clients[lo]["met"] and not by_clients[hi]["met"]
    assert [p["clients"] for p in record["probes"]][:3] == [1, 2, 4]  # (doubling first)
    # a probe is the replay with that many clients: one request in flight and one conversation each
    from simkv.replay.api import replay

    s = replay(trace, client_options(trace, config, lo), goodput={"ttft": 300}).summary
    assert s["goodput"]["slo_attainment"] == by_clients[lo]["slo_attainment"]
    assert s["peak_running"] <= lo and s["session_pacing"]["max_active_sessions"] == lo


def test_the_clients_search_says_when_no_count_or_every_count_meets_the_target():
    from simkv.studies.goodput_search import search_max_clients

    trace = _chat(20)
    config = EngineConfig.from_flat(dict(model="llama-3.1-8b"))
    assert search_max_clients(trace, config, {"ttft": 0.01})["status"] == "unattainable"
    easy = search_max_clients(trace, config, {"e2el": 10 ** 7})
    assert easy["status"] == "unbounded" and easy["max_clients"] == easy["max_clients_bound"] == 20
    req400 = read_trace("traces/req400.parquet")  # (no sessions: a client per request at most)
    assert search_max_clients(req400, config, {"e2el": 10 ** 7})["max_clients_bound"] == 400


def test_goodput_clients_command(tmp_path):
    trace = tmp_path / "chat.parquet"
    from simkv.traces.schema import write_trace

    write_trace(_chat(), trace)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["goodput", str(trace), "--goodput", "ttft:300", "--clients", "--gpu", "A100-80GB",
                                       "--model", "llama-3.1-8b", "--attainment", "0.95", "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "goodput.json").read_text())
    assert record["status"] == "found" and record["session_paced"]
    assert f"**Most clients meeting the target: {record['max_clients']}**" in (out / "goodput.md").read_text()
    refused = CliRunner().invoke(main, ["goodput", str(trace), "--goodput", "ttft:300", "--clients",
                                        "--target-rate", "5"])
    assert refused.exit_code == 2 and "--clients searches one setup" in refused.output
