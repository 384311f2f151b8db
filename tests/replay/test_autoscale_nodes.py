"""The GPU nodes under an autoscaled fleet (`--node-gpus`, simkv/replay/autoscale_nodes.py)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from simkv.clock import TICKS_PER_SECOND, to_ticks
from simkv.config import EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.replay.autoscale import AutoscaleError, AutoscaleSpec, Autoscaler
from simkv.replay.autoscale_nodes import NodePool
from simkv.traces import trace_from_frame
from tests.cli_runs import cli_fails, cli_ok
from tests.replay.test_autoscale import bursts

CONFIG = EngineConfig.from_flat({"max_model_len": 4096})
S = TICKS_PER_SECOND


def pool(**settings) -> NodePool:
    return NodePool(AutoscaleSpec(1, 2, **({"node_gpus": 8} | settings)))


def test_a_replica_goes_to_a_node_up_then_to_one_coming_then_to_a_new_one():
    nodes = pool(node_provision_s=300)
    nodes.check(("fleet", 0), 4, "H100")
    assert nodes.place(("fleet", 0), 4, "H100", 0, initial=True) == 0  # (up from the start)
    assert nodes.place(("fleet", 1), 4, "H100", 10 * S) == 10 * S  # (the free half of node 0)
    assert nodes.place(("fleet", 2), 4, "H100", 20 * S) == 320 * S  # (a new node: 300 s to join)
    assert nodes.place(("fleet", 3), 4, "H100", 30 * S) == 320 * S  # (the node coming has room: it waits)
    assert nodes.place(("fleet", 4), 2, "H200", 40 * S) == 340 * S  # (another GPU kind: its own nodes)
    assert [(n.kind, n.free) for n in nodes.nodes] == [("H100", 0), ("H100", 0), ("H200", 6)]
    assert nodes.added == [20 * S, 40 * S] and nodes.waits == [0, 0, 300 * S, 290 * S, 300 * S]


def test_pack_fills_the_fullest_node_spread_the_emptiest():
    for placement, expected in (("pack", 0), ("spread", 1)):
        nodes = pool(node_placement=placement, min_nodes=2)
        nodes.check(("fleet", 0), 2, "H100")  # (two nodes up from the start, empty)
        nodes.place(("fleet", 0), 6, "H100", 0)  # (node 0: the first of two alike)
        nodes.place(("fleet", 1), 2, "H100", 0)  # (node 0 has 2 free, node 1 has 8)
        assert nodes.held[("fleet", 0)][0] == 0 and nodes.held[("fleet", 1)][0] == expected


def test_an_empty_node_goes_after_the_unneeded_time_and_never_soon_after_an_add():
    nodes = pool(node_provision_s=0, node_unneeded_s=600, node_delay_after_add_s=0)
    nodes.place(("fleet", 0), 8, "H100", 0, initial=True)
    nodes.place(("fleet", 1), 8, "H100", 100 * S)  # (a second node, added)
    nodes.release(("fleet", 1), 200 * S)
    nodes.collect(799 * S)
    assert nodes.nodes[1].removed is None
    nodes.collect(800 * S)
    assert nodes.nodes[1].removed == 800 * S
    # a delay after an add: an H200 node added at 750 s holds the H100 node's removal until 1,350 s
    nodes = pool(node_provision_s=0, node_unneeded_s=600, node_delay_after_add_s=600)
    nodes.place(("fleet", 0), 8, "H100", 0, initial=True)
    nodes.place(("fleet", 1), 8, "H100", 100 * S)
    nodes.release(("fleet", 1), 200 * S)
    nodes.place(("fleet", 2), 8, "H100", 700 * S)  # (node 1, empty 500 s, takes it: no add)
    assert nodes.held[("fleet", 2)][0] == 1 and nodes.added == [100 * S]
    nodes.release(("fleet", 2), 710 * S)
    nodes.place(("fleet", 3), 8, "H200", 750 * S)
    nodes.collect(1349 * S)
    assert nodes.nodes[1].removed is None  # (due at 1,310 s, but within 600 s of the add at 750 s)
    nodes.collect(2000 * S)
    assert nodes.nodes[1].removed == 1350 * S and nodes.nodes[0].removed is None
    # the node group's minimum stays, empty or not
    nodes = pool(node_provision_s=0, node_unneeded_s=0, node_delay_after_add_s=0, min_nodes=1)
    nodes.check(("fleet", 0), 8, "H100")
    nodes.place(("fleet", 0), 8, "H100", 0)
    nodes.release(("fleet", 0), 10 * S)
    nodes.collect(10_000 * S)
    assert nodes.nodes[0].removed is None and nodes.section(10_000 * S)["gpu_hours"] == pytest.approx(8 * 10_000 / 3600)


def test_a_replica_larger_than_a_node_and_node_settings_alone_are_refused():
    with pytest.raises(ValueError, match="needs 16 H100 GPUs; a replica runs on one node here"):
        pool().check(("fleet", 3), 16, "H100")
    for kwargs, message in (({"min_nodes": 1}, "describe the nodes: give --node-gpus too"),
                            ({"node_gpus": 1.5}, "--node-gpus must be a whole number"),
                            ({"node_gpus": 8, "node_unneeded_s": -1}, "--node-unneeded-s must be a number"),
                            ({"node_gpus": 8, "node_placement": "random"}, "expected one of pack, spread")):
        with pytest.raises(AutoscaleError, match=message):
            AutoscaleSpec(1, 2, **kwargs)


def test_free_nodes_of_one_replica_each_cost_what_the_replicas_cost():
    """Nodes of one replica's GPUs, joining at once and removed once empty, change nothing: the
    same requests, and the nodes' GPU-hours are the replicas' own."""
    spec = dict(target=8, interval_s=15, cold_start_s=45, scale_down_window_s=120)
    plain = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=AutoscaleSpec(1, 4, **spec)))
    free = AutoscaleSpec(1, 4, **spec, node_gpus=1, node_provision_s=0, node_unneeded_s=0, node_delay_after_add_s=0)
    nodes = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=free))
    pd.testing.assert_frame_equal(plain.requests, nodes.requests)
    scaling = nodes.summary["fleet"]["autoscaling"]
    assert scaling["replica_gpu_hours"] == pytest.approx(plain.summary["fleet"]["autoscaling"]["gpu_hours"])
    assert scaling["gpu_hours"] == pytest.approx(scaling["replica_gpu_hours"])
    section = scaling["nodes"]
    assert section["nodes_added"] >= 3 and section["nodes_removed"] >= 3
    assert section["replicas_waiting_for_a_node"] == 0 and section["peak_nodes"] == 4


def test_a_node_to_provision_delays_the_replicas_and_is_paid_while_empty():
    """Nodes of 2 GPUs (one H100 replica each takes 1): the burst's scale-up puts replica 1 on
    the free GPU of the node up from the start, ready after its cold start; replicas 2 and 3
    wait 200 s for a new node, so the burst is over before they are ready and they are called
    off. The new node is paid all the same, from its provisioning until 600 s after it joined
    empty."""
    spec = AutoscaleSpec(1, 4, target=8, interval_s=15, cold_start_s=45, scale_down_window_s=120, node_gpus=2,
                         node_provision_s=200, node_unneeded_s=600, node_delay_after_add_s=0)
    result = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    scaling, requests = result.summary["fleet"]["autoscaling"], result.requests
    assert [(e["time_s"], e["action"], e["replicas"]) for e in scaling["events"]] == [(75.0, "up", 4),
                                                                                     (255.0, "down", 1)]
    assert requests.loc[requests["replica"] == 1, "arrival_time_s"].min() >= 75.0 + 45.0
    assert set(requests["replica"]) == {0, 1}  # (2 and 3 would be ready at 75 + 200 + 45 s)
    assert [(p["time_s"], p["ready"], p["starting"]) for p in scaling["timeline"]] == [
        (0.0, 1, 0), (75.0, 1, 3), (120.0, 2, 2), (255.0, 1, 0)]
    nodes = scaling["nodes"]
    assert (nodes["nodes_at_start"], nodes["nodes_added"], nodes["nodes_removed"], nodes["peak_nodes"]) == (1, 1, 1, 2)
    assert (nodes["nodes_up_at_end"], nodes["empty_nodes_at_end"]) == (1, 0)
    assert nodes["replicas_waiting_for_a_node"] == 2 and nodes["mean_node_wait_s"] == 200.0
    assert nodes["timeline"] == [{"time_s": 0.0, "nodes": 1}, {"time_s": 75.0, "nodes": 2},
                                 {"time_s": 875.0, "nodes": 1}]  # (joined at 275 s, empty: gone 600 s later)
    duration = result.summary["duration_s"]
    assert nodes["gpu_hours"] == pytest.approx(2 * (duration + 800.0) / 3600)
    assert scaling["gpu_hours"] == nodes["gpu_hours"] and scaling["gpu_hours_by_gpu"] == nodes["gpu_hours_by_gpu"]
    # held: replica 0 all along, replica 1 from 75 s to its drain's last finish; 2 and 3 never
    paid = result.summary["fleet"]["replicas"]
    assert nodes["held_gpu_hours"] == pytest.approx((paid[0]["paid_s"] + paid[1]["paid_s"]) / 3600)
    assert nodes["idle_gpu_share"] == pytest.approx(1 - nodes["held_gpu_hours"] / nodes["gpu_hours"])
    again = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    assert again.summary["fleet"]["autoscaling"] == scaling


def test_pd_pools_share_the_nodes():
    from simkv.config import ConfigError
    from simkv.replay.disaggregated import DisaggregationSpec

    common = dict(cold_start_s=30, scale_down_window_s=120, node_gpus=2, node_provision_s=100)
    spec = DisaggregationSpec(num_prefill=2, num_decode=3,
                              prefill_autoscale=AutoscaleSpec(1, 2, metric="waiting", target=2, **common),
                              decode_autoscale=AutoscaleSpec(1, 3, metric="kv_usage", target=0.02, **common))
    config = EngineConfig.from_flat({"max_model_len": 4096, "max_num_seqs": 16})
    summary = replay(bursts(), config, disaggregation=spec).summary
    pools = summary["disaggregation"]
    nodes = pools["autoscaling"]["nodes"]
    assert nodes["nodes_at_start"] == 1  # (the prefill and the decode replica up from the start share a node)
    assert pools["autoscaling"]["gpu_hours"] == nodes["gpu_hours"] > 0
    replicas = pools["prefill"]["autoscaling"]["gpu_hours"] + pools["decode"]["autoscaling"]["gpu_hours"]
    assert nodes["held_gpu_hours"] < replicas  # (a replica holds a node's GPU once the node is up)
    assert "nodes" not in pools["prefill"]["autoscaling"]
    with pytest.raises(ConfigError, match="share the cluster's nodes"):
        DisaggregationSpec(num_prefill=2, num_decode=2, prefill_autoscale=AutoscaleSpec(1, 2, node_gpus=2),
                           decode_autoscale=AutoscaleSpec(1, 2, node_gpus=4))


def test_a_drained_replica_started_again_reads_its_requests_now_not_as_delayed():
    """With a metrics delay, a drained slot whose last request is done starts again as a new
    pod, though the delayed reading still shows it busy."""
    scaler = Autoscaler(AutoscaleSpec(1, 2, target=1, interval_s=5, scale_down_window_s=0,
                                      metrics_delay_s=30, cold_start_s=10))
    second = to_ticks(1.0)
    scaler._start(1, 0, 0)  # (slot 1 up from 0, ready at 10 s)
    scaler.history.routed(1, 12 * second)
    scaler.history.finished(1, 60 * second, 1)
    scaler.draining_since[1] = 50 * second
    scaler.last_finish[1] = 60 * second
    for t in (40, 41, 42):
        scaler.history.routed(0, t * second)
    scaler._evaluate(75 * second, [3, 0])  # (as read at 45 s, slot 1 still had its request)
    assert scaler.ready_at[1] == 85 * second  # (a new pod: its cold start, not warm)
    assert scaler.paid[1] == [(0, 60 * second), (75 * second, None)]


def test_the_cli_takes_the_node_flags(tmp_path):
    from simkv.traces import write_trace

    trace = tmp_path / "b.parquet"
    write_trace(bursts(), trace)
    text = cli_ok(["replay", str(trace), "--autoscale", "1-4", "--cold-start-s", "30", "--node-gpus", "4",
                   "--node-provision-s", "120", "--min-nodes", "1", "--node-placement", "spread",
                   "--max-model-len", "4096", "--out", str(tmp_path / "r")])
    assert "nodes of 4 GPUs" in text.replace("\n", " ").replace("│", " ")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    nodes = summary["fleet"]["autoscaling"]["nodes"]
    assert (nodes["gpus_per_node"], nodes["provision_s"], nodes["min_nodes"], nodes["placement"]) == (
        4, 120.0, 1, "spread")
    assert "GPU nodes (4 GPUs each)" in (tmp_path / "r" / "report.html").read_text()
    for args, message in ((["--autoscale", "1-2", "--min-nodes", "1"], "give --node-gpus too"),
                          (["--autoscale", "1-2", "--node-gpus", "1", "-tp", "2"], "needs 2"),
                          (["--prefill-replicas", "1", "--decode-autoscale", "1-2:node_gpus=8"],
                           "the nodes are the cluster's")):
        assert message in cli_fails(["replay", str(trace), "--max-model-len", "4096", *args])


def test_a_sweep_grids_the_nodes(tmp_path):
    import pyarrow.parquet as pq

    from simkv.traces import write_trace

    trace = tmp_path / "b.parquet"
    write_trace(bursts(), trace)
    cli_ok(["sweep", str(trace), "--set", "autoscale=1-4", "--set", "cold_start_s=30", "--set", "max_model_len=4096",
            "--grid", "node_gpus=0,2,8", "--out", str(tmp_path / "s"), "--quiet"])
    rows = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    assert [row["status"] for row in rows] == ["ok"] * 3
    assert rows[0]["node_idle_share"] is None and 0 < rows[1]["node_idle_share"] < rows[2]["node_idle_share"]
    cell = json.loads((tmp_path / "s" / "cells" / rows[2]["cell_id"] / "summary.json").read_text())
    assert rows[2]["gpu_hours"] == cell["fleet"]["autoscaling"]["nodes"]["gpu_hours"]
    assert rows[2]["gpu_hours"] > rows[0]["gpu_hours"]  # (an 8-GPU node paid whole from the start)
    assert "node_idle_share" in (tmp_path / "s" / "sweep.md").read_text()


def test_a_new_node_pulls_the_image_once_for_its_replicas():
    """--node-image-pull-s: the first replica on a node that has not pulled the server's image
    waits for the pull after the node joins; a replica placed there during the pull waits for
    the same pull; later ones, and nodes up from the start, pull nothing."""
    nodes = pool(node_provision_s=100, node_image_pull_s=60)
    assert nodes.place(("fleet", 0), 2, "H100", 0, initial=True) == 0
    assert nodes.place(("fleet", 1), 2, "H100", 10 * S) == 10 * S  # (node 0 has the image)
    assert nodes.place(("fleet", 2), 4, "H100", 20 * S) == 20 * S  # (node 0's last 4 GPUs)
    assert nodes.place(("fleet", 3), 4, "H100", 30 * S) == 190 * S  # (joins at 130 s, pulls until 190 s)
    assert nodes.place(("fleet", 4), 2, "H100", 150 * S) == 190 * S  # (during the pull: the same pull)
    assert nodes.place(("fleet", 5), 2, "H100", 200 * S) == 200 * S
    assert nodes.waits[-3:] == [160 * S, 40 * S, 0]
    kept = pool(node_image_pull_s=60, min_nodes=1)
    kept.check(("fleet", 0), 1, "H100")
    assert kept.place(("fleet", 0), 1, "H100", 5 * S) == 5 * S  # (a kept node has it: pre-pulled)
    spec = AutoscaleSpec(1, 4, target=8, interval_s=15, cold_start_s=45, scale_down_window_s=120, node_gpus=2,
                         node_provision_s=0, node_image_pull_s=30, node_unneeded_s=600, node_delay_after_add_s=0)
    scaling = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec)).summary[
        "fleet"]["autoscaling"]
    # the first scale-up at 75 s: replica 1 on node 0 (ready at 120 s), 2 and 3 on a new node (pull, then 45 s)
    assert [(p["time_s"], p["ready"]) for p in scaling["timeline"]][:3] == [(0.0, 1), (75.0, 1), (120.0, 2)]
    assert (150.0, 4) in [(p["time_s"], p["ready"]) for p in scaling["timeline"]]
    assert scaling["nodes"]["image_pull_s"] == 30.0 and scaling["nodes"]["mean_node_wait_s"] == 30.0


def test_nodes_that_fail_are_drawn_seeded_and_take_their_replicas():
    """--node-mtbf-s: each node's failure drawn when it is made (seeded); a failed node goes at
    once with its replicas' GPUs, and a kept node is replaced by a new one."""
    def drawn(seed):
        nodes = pool(node_mtbf_s=100.0, node_failure_seed=seed, min_nodes=1, node_provision_s=10)
        nodes.check(("fleet", 0), 2, "H100")
        nodes.place(("fleet", 0), 2, "H100", 0)
        nodes.place(("fleet", 1), 8, "H100", 0)  # (a second node)
        return nodes
    a, b, c = drawn(1), drawn(1), drawn(2)
    assert [n.fails_at for n in a.nodes] == [n.fails_at for n in b.nodes] != [n.fails_at for n in c.nodes]
    at, i = a.next_failure()
    assert at == min(n.fails_at for n in a.nodes)
    held = sorted(key for key, (j, _) in a.held.items() if j == i)
    assert a.fail(i, at) == held and a.nodes[i].removed == at and not any(a.holds(k) for k in held)
    if i == 0:  # (the kept node: a new one in its place, joining 10 s later)
        assert a.nodes[-1].kept and a.nodes[-1].start == at and a.nodes[-1].ready == at + 10 * S
    assert a.section(at)["nodes_failed"] == 1
    with pytest.raises(AutoscaleError, match="give --node-gpus too"):
        AutoscaleSpec(1, 2, node_mtbf_s=100.0)
    from simkv.config import ConfigError
    from simkv.replay.disaggregated import DisaggregationSpec

    with pytest.raises(ConfigError, match="not modelled yet under P/D pools"):
        DisaggregationSpec(num_prefill=2, num_decode=2,
                           decode_autoscale=AutoscaleSpec(1, 2, node_gpus=2, node_mtbf_s=100.0))


@pytest.mark.parametrize("retries", [0, 1])
def test_a_failed_nodes_replicas_lose_their_requests_and_start_again(retries):
    """Nodes of 2 GPUs failing every 200 s on average: at each node failure its replicas'
    requests in flight are lost (failed without retries; retried and finished with one), the
    replicas start again as new pods (none takes a request before its cold start ends), and the
    losses add up."""
    from simkv.config import EngineConfig as Config

    spec = AutoscaleSpec(1, 4, target=8, interval_s=15, cold_start_s=20, scale_down_window_s=120, node_gpus=2,
                         node_provision_s=30, node_mtbf_s=200.0, node_failure_seed=3)
    config = Config.from_flat({"max_model_len": 4096, "client_max_retries": retries} if retries else
                              {"max_model_len": 4096})
    result = replay(bursts(), config, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    scaling, requests = result.summary["fleet"]["autoscaling"], result.requests
    failures = [(e["time_s"], e["replica"]) for e in scaling["events"] if e["action"] == "node_failure"]
    nodes = scaling["nodes"]
    assert len(failures) >= 2 and nodes["nodes_failed"] >= 2 and nodes["requests_lost"] > 0
    failed = requests[requests["status"] == "failed"]
    if retries:
        assert nodes["requests_failed"] == 0 and (requests["status"] == "finished").all()
    else:
        assert len(failed) == nodes["requests_lost"] == nodes["requests_failed"]
        for _, row in failed.iterrows():  # (each lost with the node under its replica)
            assert any(r == row["replica"] and row["arrival_time_s"] <= t for t, r in failures)
    for t, r in failures:  # (a new pod: its first request after its cold start at the least)
        later = requests[(requests["replica"] == r) & (requests["first_scheduled_time_s"] > t)]
        assert later.empty or later["first_scheduled_time_s"].min() >= t + 20.0
    again = replay(bursts(), config, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    pd.testing.assert_frame_equal(requests, again.requests)


def test_a_nodes_reclaim_notice_cordons_it_and_bounds_its_replicas_end():
    """--node-reclaim-notice-s: the node is warned that long before its failure (not before it
    was made): nothing more is placed on it, its replicas leave it then, and they lose what they
    run at the failure, or at a scale-down's end (--shutdown-timeout) if sooner."""
    def drawn(**settings):
        nodes = pool(node_mtbf_s=100.0, node_failure_seed=1, node_provision_s=10, node_reclaim_notice_s=30,
                     **settings)
        nodes.check(("fleet", 0), 2, "H100")
        nodes.place(("fleet", 0), 2, "H100", 0, initial=True)
        return nodes
    nodes = drawn()
    node = nodes.nodes[0]
    assert node.notice_at == max(0, node.fails_at - 30 * S) and node.loses_at == node.fails_at
    assert nodes.next_failure() == (node.notice_at, 0) and nodes.due_notice(0)
    assert nodes.failure_of(("fleet", 0)) == node.fails_at
    assert nodes.cordon(0, node.notice_at) == [("fleet", 0)] and not nodes.holds(("fleet", 0))
    assert nodes.next_failure() == (node.fails_at, 0) and not nodes.due_notice(0)
    nodes.place(("fleet", 0), 2, "H100", node.notice_at)  # (elsewhere: a new node)
    assert nodes.held[("fleet", 0)][0] == 1 and nodes.nodes[1].start == node.notice_at
    bounded = drawn(shutdown_timeout_s=5.0).nodes[0]
    assert bounded.loses_at == min(bounded.fails_at, bounded.notice_at + 5 * S)
    with pytest.raises(AutoscaleError, match="give --node-mtbf-s too"):
        AutoscaleSpec(1, 2, node_gpus=2, node_reclaim_notice_s=30)


@pytest.mark.parametrize("shutdown_timeout_s", [None, 0.0])
def test_a_reclaim_notice_replaces_the_replicas_before_their_node_fails(shutdown_timeout_s):
    """With a 60 s notice the evicted replicas take no request from the notice on, their
    replacements none before their cold start nor before the old pod's end; what is lost was
    sent before a notice, to a replica it evicted. With vLLM's default --shutdown-timeout 0 the
    old pods end at the notice itself."""
    spec = AutoscaleSpec(1, 4, target=8, interval_s=15, cold_start_s=20, scale_down_window_s=120, node_gpus=2,
                         node_provision_s=30, node_mtbf_s=200.0, node_failure_seed=3, node_reclaim_notice_s=60,
                         **({} if shutdown_timeout_s is None else {"shutdown_timeout_s": shutdown_timeout_s}))
    result = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    scaling, requests = result.summary["fleet"]["autoscaling"], result.requests
    notices = [(e["time_s"], e["replica"], e["ends_s"]) for e in scaling["events"] if e["action"] == "node_notice"]
    assert len(notices) >= 2 and scaling["nodes"]["reclaim_notice_s"] == 60.0
    assert not [e for e in scaling["events"] if e["action"] == "node_failure"]  # (every replica left at its notice)
    for t, r, ends in notices:
        assert ends == t if shutdown_timeout_s == 0.0 else ends > t
        later = requests[(requests["replica"] == r) & (requests["arrival_time_s"] >= t)]
        assert later.empty or later["first_scheduled_time_s"].min() >= max(t + 20.0, ends)
    failed = requests[requests["status"] == "failed"]
    assert len(failed) == scaling["nodes"]["requests_lost"]
    for _, row in failed.iterrows():
        assert any(r == row["replica"] and row["arrival_time_s"] < t for t, r, _ in notices)
    if shutdown_timeout_s == 0.0:
        assert len(failed) > 0


@pytest.mark.parametrize("notice_s, shutdown_timeout_s", [(20, None), (20, 0.0), (60, 5.0)])
def test_decode_runs_change_no_bytes_with_reclaim_notices(notice_s, shutdown_timeout_s):
    """Nodes warned before they fail, pods that drain or not, replicas scaling: jumping over
    decode runs changes no request and no decision."""
    extra = {} if shutdown_timeout_s is None else {"shutdown_timeout_s": shutdown_timeout_s}
    spec = AutoscaleSpec(1, 3, target=8, cold_start_s=20, scale_down_window_s=60, node_gpus=2, node_provision_s=30,
                         node_mtbf_s=150.0, node_failure_seed=2, node_reclaim_notice_s=notice_s, **extra)
    config = EngineConfig.from_flat({"max_model_len": 4096, "client_max_retries": 1})
    runs = [replay(bursts(), config, fleet=FleetSpec(3, "least_outstanding", autoscale=spec), use_decode_runs=flag)
            for flag in (True, False)]
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)
    scaling = [run.summary["fleet"]["autoscaling"] for run in runs]
    assert scaling[0]["events"] == scaling[1]["events"] and scaling[0]["nodes"]["nodes_failed"] > 0
    assert any(e["action"] == "node_notice" for e in scaling[0]["events"])


def test_requests_held_for_a_replica_whose_node_fails_wait_for_its_next_pod():
    """MIN 0 on one-GPU nodes that fail every 15 s on average: the first requests wait for a
    replica whose node fails twice before it is up (at 16.1 and 20.7 s); they wait for the pod
    placed after the second failure, ready 20 s later, and none is lost (none reached a pod that
    failed). Decode runs change no byte."""
    arrivals = np.arange(0.0, 6.0, 0.5)
    n = len(arrivals)
    trace = trace_from_frame(pd.DataFrame({"arrival_time_s": arrivals, "prompt_tokens": [500] * n,
                                           "output_tokens": [50] * n}))
    spec = AutoscaleSpec(0, 2, target=64, cold_start_s=20, scale_down_window_s=60, node_gpus=1, node_provision_s=0,
                         node_mtbf_s=15.0, node_failure_seed=1)
    runs = [replay(trace, CONFIG, fleet=FleetSpec(2, "least_outstanding", autoscale=spec), use_decode_runs=flag)
            for flag in (True, False)]
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)
    scaling, requests = runs[0].summary["fleet"]["autoscaling"], runs[0].requests
    failures = [e["time_s"] for e in scaling["events"] if e["action"] == "node_failure"]
    assert len(failures) == 2 and failures[-1] < 21.0
    assert (requests["status"] == "finished").all() and scaling["nodes"]["requests_lost"] == 0
    assert requests["first_scheduled_time_s"].min() == pytest.approx(failures[-1] + 20.0)
