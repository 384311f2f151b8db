"""Encoder disaggregation (`--encode-replicas`, simkv/replay/encode_pool.py): encode instances in
front of the engines, replayed in two passes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.backends.vision_encoder import VisionEncoderCost
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.replay.disaggregated import DisaggregationSpec
from simkv.replay.encode_pool import EncodeSpec
from simkv.specs import get_gpu_spec, get_model_spec
from simkv.traces import trace_from_frame, write_trace

EMBED_BYTES = 3584 * 2  # (Qwen2.5-VL-7B: one embedding in the store, bf16)


def _config(**options) -> EngineConfig:
    return EngineConfig.from_flat({"model": "qwen2.5-vl-7b", "gpu": "H100-SXM", "max_model_len": 8192} | options)


def _trace(hashes, arrivals=None, image_tokens: int = 1024):
    """Requests of 200 text tokens, an image (`hashes`: its identifier, or None for a text-only
    request of the same length), 100 more; 32 output tokens."""
    n = len(hashes)
    frame = pd.DataFrame({"arrival_time_s": np.arange(n) * 1.0 if arrivals is None else arrivals,
                          "prompt_tokens": [300 + image_tokens] * n, "output_tokens": [32] * n,
                          "mm_offsets": [[200] if h is not None else [] for h in hashes],
                          "mm_lengths": [[image_tokens] if h is not None else [] for h in hashes],
                          "mm_hashes": [[h] if h is not None else [] for h in hashes]})
    return trace_from_frame(frame)


def test_a_request_waits_for_the_encode_instance_then_loads_its_embeddings():
    """A lone request: its first token comes later than on one engine that encodes by the encode
    instance's step overhead (1 ms), writing and reading the embeddings (1,024 x 7,168 bytes at
    10 GB/s each) and the proxy's hop (1 ms); the engine encodes nothing."""
    one = replay(_trace([1]), _config())
    split = replay(_trace([1]), _config(), encode=EncodeSpec(1))
    store = 1024 * EMBED_BYTES / 10e9
    later = split.requests["ttft_s"][0] - one.requests["ttft_s"][0]
    assert later == pytest.approx(1e-3 + 2 * store + 1e-3, abs=3e-6)
    cost = VisionEncoderCost(get_model_spec("qwen2.5-vl-7b"), get_gpu_spec("H100-SXM"))
    assert split.requests["encode_s"][0] == pytest.approx(1e-3 + cost.seconds((1024,)) + store + 1e-3, abs=2e-6)
    mm, pool = split.summary["multimodal"], split.summary["encode_pool"]
    assert mm["items_encoded"] == 0 and mm["items_loaded_from_store"] == 1
    assert mm["store_read_seconds"] == pytest.approx(store)
    assert pool["items_encoded"] == 1 and pool["encoder_seconds"] == pytest.approx(cost.seconds((1024,)))
    assert split.requests["arrival_time_s"][0] == 0.0  # (latencies from the client's send)


def test_an_image_in_the_store_is_not_encoded_again_by_any_encode_instance():
    """Two encode instances share the store: the same image sent again later is found there."""
    result = replay(_trace([7, 7, 8]), _config(), encode=EncodeSpec(2, router="round_robin"))
    pool = result.summary["encode_pool"]
    assert pool["items_encoded"] == 2 and pool["items_found_in_store"] == 1


def test_requests_without_images_go_to_the_engines_directly():
    trace = _trace([None, 1, None], arrivals=[0.0, 5.0, 10.0])
    split = replay(trace, _config(), encode=EncodeSpec(1)).requests
    plain = replay(trace, _config()).requests
    assert list(split["encode_s"] > 0) == [False, True, False]
    assert split["ttft_s"][0] == plain["ttft_s"][0] and split["ttft_s"][2] == plain["ttft_s"][2]
    assert split["request_id"].tolist() == plain["request_id"].tolist()


def test_the_pool_fronts_a_fleet_or_pd_pools_alike():
    trace = _trace([1, 2, 3, 4], arrivals=[0.0, 0.01, 0.02, 0.03])
    fleet = replay(trace, _config(), fleet=FleetSpec(2), encode=EncodeSpec(1)).summary
    pd = replay(trace, _config(), disaggregation=DisaggregationSpec(1, 1), encode=EncodeSpec(1)).summary
    for summary in (fleet, pd):
        assert summary["encode_pool"]["items_encoded"] == 4 and summary["multimodal"]["items_encoded"] == 0
    assert pd["disaggregation"]["prefill"]["multimodal"]["items_loaded_from_store"] == 4


def test_an_encode_instance_batches_within_its_token_budget():
    """Eight requests at once whose prompts (1,324 tokens) fill the encode instance's token budget
    six at a time: the last two wait a step; with a budget of 16,384 all go in one step."""
    trace = _trace(list(range(1, 9)), arrivals=[0.0] * 8)
    steps = {}
    for budget in (8192, 16384):
        pool = replay(trace, _config(), encode=EncodeSpec(1, encode_options=(("max_num_batched_tokens", budget),)))
        steps[budget] = sorted(set(np.round(pool.requests["encode_s"], 6)))
    assert len(steps[8192]) == 2 and len(steps[16384]) == 1


def test_a_class_keeps_its_replicas_behind_the_encode_instances():
    """The engines' pass routes by request class as a fleet without encode instances does; the
    instances encode every class's images."""
    trace = _trace([1, 2, 3, 4, 5, 6], arrivals=[0.0, 0.01, 0.02, 0.03, 0.04, 0.05])
    from dataclasses import replace

    trace = replace(trace, request_class=np.array(["docs", "chat"] * 3, dtype=object))
    fleet = FleetSpec(3, "least_outstanding", class_replicas=(("docs", (2,)),))
    result = replay(trace, _config(), fleet=fleet, encode=EncodeSpec(1))
    requests = result.requests
    assert set(requests.loc[requests["request_class"] == "docs", "replica"]) == {2}
    assert set(requests.loc[requests["request_class"] == "chat", "replica"]) <= {0, 1}
    assert result.summary["encode_pool"]["items_encoded"] == 6
    assert (requests["encode_s"] > 0).all()
    pools = DisaggregationSpec(1, 2, decode_class_replicas=(("docs", (1,)),))
    split = replay(trace, _config(), disaggregation=pools, encode=EncodeSpec(1)).requests
    assert set(split.loc[split["request_class"] == "docs", "decode_replica"]) == {1}


@pytest.mark.parametrize("frame_change, options, message", [
    ({"mm_offsets": [[]] * 2, "mm_lengths": [[]] * 2, "mm_hashes": [[]] * 2}, {},
     "the trace has no multimodal items"),
    ({"session_id": ["a", "a"]}, {}, "conversations paced on their replies"),
    ({}, {"client_ttft_timeout_s": 5.0}, "clients that give up"),
    ({}, {"model": "llama-3-8b"}, "llama-3-8b has no vision encoder"),
])
def test_what_two_passes_cannot_replay_is_refused(frame_change, options, message):
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [1324, 1324], "output_tokens": [8, 8],
                          "mm_offsets": [[200]] * 2, "mm_lengths": [[1024]] * 2, "mm_hashes": [[1], [2]]})
    for key, value in frame_change.items():
        frame[key] = value
    with pytest.raises((ConfigError, ValueError), match=message):
        replay(trace_from_frame(frame), _config(**options), encode=EncodeSpec(1))


def test_the_cli_writes_the_pool_and_refuses_its_flags_alone(tmp_path: Path):
    path = tmp_path / "t.parquet"
    write_trace(_trace([1, 2]), path)
    out = tmp_path / "out"
    args = ["replay", str(path), "--model", "qwen2.5-vl-7b", "--max-model-len", "8192", "--quiet", "--out", str(out)]
    result = CliRunner().invoke(main, args + ["--encode-replicas", "2", "--encode-set", "max_num_seqs=8",
                                              "--ec-store-gbs", "20"])
    assert result.exit_code == 0, result.output
    pool = json.loads((out / "summary.json").read_text())["encode_pool"]
    assert pool["encode_replicas"] == 2 and pool["encode_options"] == {"max_num_seqs": 8}
    assert pool["ec_store_gbs"] == 20.0 and pool["config"]["max_num_seqs"] == 8
    assert "encode_s" in pd.read_parquet(out / "requests.parquet")
    again = CliRunner().invoke(main, args[:-1] + [str(tmp_path / "again"), "--encode-replicas", "2", "--encode-set",
                                                  "max_num_seqs=8", "--ec-store-gbs", "20"])
    assert again.exit_code == 0
    for name in ("summary.json", "requests.parquet", "steps.parquet"):  # (same inputs: the same bytes)
        if name == "summary.json":
            a, b = (json.loads((d / name).read_text()) for d in (out, tmp_path / "again"))
            a.pop("wall_time_s"), b.pop("wall_time_s")
            assert a == b
        else:
            assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    alone = CliRunner().invoke(main, args[:-1] + [str(tmp_path / "x"), "--ec-store-gbs", "20"])
    assert alone.exit_code != 0 and "give --encode-replicas too" in alone.output
    assert not (tmp_path / "x").exists()


def test_goodput_searches_a_setup_with_an_encode_pool(tmp_path: Path):
    """`simkv goodput --encode-replicas`: each probe replays the encode pool in front."""
    path = tmp_path / "t.parquet"
    write_trace(_trace(list(range(1, 41)), arrivals=np.arange(40) * 0.05), path)
    out = tmp_path / "g"
    result = CliRunner().invoke(main, ["goodput", str(path), "--model", "qwen2.5-vl-7b", "--max-model-len", "8192",
                                       "--goodput", "ttft:500", "--encode-replicas", "1", "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "goodput.json").read_text())
    assert record["status"] == "found" and record["encode_pool"]["encode_replicas"] == 1
    assert "1 encode instance(s) in front" in (out / "goodput.md").read_text()
    refused = CliRunner().invoke(main, ["goodput", str(path), "--model", "qwen2.5-vl-7b", "--goodput", "ttft:500",
                                        "--encode-replicas", "1", "--pd-splits", "4"])
    assert refused.exit_code != 0 and "--encode-replicas searches one setup" in refused.output


def test_a_config_file_gives_the_pool_and_a_flag_wins(tmp_path: Path):
    path = tmp_path / "t.parquet"
    write_trace(_trace([1, 2]), path)
    config = tmp_path / "c.yaml"
    config.write_text("model: qwen2.5-vl-7b\nmax_model_len: 8192\nencode_pool:\n  encode_replicas: 2\n"
                      "  ec_store_gbs: 20\n  encode:\n    max_num_seqs: 4\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["replay", str(path), "--config", str(config), "--encode-hop-ms", "3",
                                       "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    pool = json.loads((out / "summary.json").read_text())["encode_pool"]
    assert (pool["encode_replicas"], pool["ec_store_gbs"], pool["encode_hop_ms"]) == (2, 20.0, 3.0)
    assert pool["encode_options"] == {"max_num_seqs": 4}
    config.write_text("model: qwen2.5-vl-7b\nencode_pool:\n  encode_replicas: 1\n  encoders: 2\n")
    bad = CliRunner().invoke(main, ["replay", str(path), "--config", str(config), "--out", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "encode_pool: unknown key(s) encoders" in bad.output


def test_a_sweep_grids_the_encode_pool(tmp_path: Path):
    path = tmp_path / "t.parquet"
    write_trace(_trace([1, 2, 3]), path)
    out = tmp_path / "sweep"
    result = CliRunner().invoke(main, ["sweep", str(path), "--set", "model=qwen2.5-vl-7b", "--set", "max_model_len=8192",
                                       "--grid", "encode_replicas=0,1", "--workers", "1", "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(out / "sweep.parquet")
    assert frame["status"].tolist() == ["ok", "ok"] and frame["encode_replicas"].tolist() == [0, 1]
    pooled = frame.loc[frame["encode_replicas"] == 1, "ttft_p50_s"].item()
    alone = frame.loc[frame["encode_replicas"] == 0, "ttft_p50_s"].item()
    assert pooled > alone  # (the encode instance's step, the store and the proxy's hop come first)


def test_gpu_prices_cost_the_encode_pool_too(tmp_path: Path):
    """`--gpu-price` with `--encode-replicas`: the encode instances' GPUs are paid from the start to
    the end beside the engine's, each kind at its price."""
    path = tmp_path / "t.parquet"
    write_trace(_trace([1, 2]), path)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["replay", str(path), "--model", "qwen2.5-vl-7b", "--max-model-len", "8192",
                                       "--quiet", "--out", str(out), "--encode-replicas", "2", "--encode-set",
                                       "gpu=H200", "--gpu-price", "H100-SXM=2", "--gpu-price", "H200=3"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    hours = summary["duration_s"] / 3600
    assert {k["gpu"]: k["gpu_hours"] for k in summary["cost"]["kinds"]} == pytest.approx(
        {"H100-SXM": hours, "H200": 2 * hours})
    assert summary["cost"]["usd_spent"] == pytest.approx(2 * hours + 3 * 2 * hours)
