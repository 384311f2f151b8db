"""Seed article 002's published tables, reproduced with simkv's general options."""

import json

import pytest
from click.testing import CliRunner

from simkv.cli.main import main
from simkv.studies.seed002 import make_tables, prefix_cached_tokens


@pytest.fixture(scope="module")
def tables():
    return make_tables("seed")


def test_contiguous_and_paged(tables):
    assert tables["contiguous"] == {"peak_concurrency": 24, "steps": 3524}
    assert tables["paged"] == {"peak_concurrency": 157, "steps": 1264, "preemptions": 4,
                               "internal_fragmentation_pct": 1.02, "peak_blocks_used": 6247, "total_blocks": 6250}


def test_block_size_sweep(tables):
    got = [(r["block_size"], r["peak_concurrency"], r["internal_fragmentation_pct"], r["preemptions"], r["steps"])
           for r in tables["block_size_sweep"]]
    assert got == [(8, 158, 0.50, 6, 1264), (16, 157, 1.02, 4, 1264), (32, 155, 2.18, 2, 1264),
                   (64, 153, 4.58, 7, 1264), (128, 147, 9.08, 8, 1295)]


def test_watermark_sweep(tables):
    got = [(r["watermark"], r["peak_concurrency"], r["preemptions"], r["steps"]) for r in tables["watermark_sweep"]]
    assert got == [(0.0, 157, 4, 1264), (0.01, 156, 0, 1264), (0.02, 154, 0, 1264), (0.05, 152, 0, 1265),
                   (0.10, 145, 0, 1279)]


def test_prefix_granularity(tables):
    for row in tables["prefix_granularity"]:
        p, b = row["prefix_tokens"], row["block_size"]
        assert row["cached_tokens"] == (p // b) * b
    assert {(r["prefix_tokens"], r["block_size"]): r["lost_pct"] for r in tables["prefix_granularity"]}[(1000, 64)] == 4.00


def test_prefix_granularity_same_under_vllm_semantics():
    assert prefix_cached_tokens(1000, 16, "vllm") == 992


def test_seed_model_through_the_replay_cli(tmp_path):
    runner = CliRunner()
    args = ["replay", "traces/req400.parquet", "--config", "reports/seed002/seed_model.yaml", "--cost-model", "unit",
            "--quiet", "--out"]
    r = runner.invoke(main, args + [str(tmp_path / "paged")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "paged" / "summary.json").read_text())
    assert (s["num_steps"], s["num_preemptions"], round(s["internal_fragmentation_pct"], 2)) == (1264, 4, 1.02)
    cfg = tmp_path / "contiguous.yaml"
    with open("reports/seed002/seed_model.yaml") as f:
        cfg.write_text(f.read().replace("allocator: paged", "allocator: contiguous"))
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--config", str(cfg), "--cost-model", "unit",
                             "--quiet", "--out", str(tmp_path / "contiguous")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "contiguous" / "summary.json").read_text())
    assert s["num_steps"] == 3524 and s["num_preemptions"] == 0
    assert s["allocator_stats"]["allocator"] == "contiguous"
