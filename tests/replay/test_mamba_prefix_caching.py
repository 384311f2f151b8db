"""Prefix caching on models with linear-attention layers (vLLM's mamba_cache_mode "align",
core/mamba_align.py): the scheduler against vLLM 0.33's on recorded cases, the block-aligned
prefill split, the block size the kernels' checkpoints align, the state blocks a request holds,
and replays with and without prefix caching."""

import json
from pathlib import Path

import pytest

from simkv.capacity import compute_capacity, group_blocks_per_request
from simkv.config import EngineConfig
from simkv.core.mamba_align import checkpoint_exportable, mamba_block_aligned_split, prefill_checkpoint_position
from simkv.traces.schema import read_trace
from tests.core.helpers import (assert_decode_runs_change_nothing, assert_same_async_spec_steps_as_vllm,
                                assert_same_steps_as_vllm)
from tests.replay.test_linear_attention import QWEN3_NEXT, _rooted

ROOT = Path(__file__).resolve().parents[2]
CASES = json.loads((ROOT / "tests" / "core" / "data" / "linear_align_vllm_cases.json").read_text())["cases"]
ASYNC_CASES = json.loads((ROOT / "tests" / "core" / "data" / "linear_align_async_vllm_cases.json").read_text())["cases"]
SPEC_CASES = json.loads((ROOT / "tests" / "core" / "data" / "linear_align_spec_vllm_cases.json").read_text())["cases"]
SPEC_ASYNC_CASES = json.loads(
    (ROOT / "tests" / "core" / "data" / "linear_align_spec_async_vllm_cases.json").read_text())["cases"]


def _config(**options) -> EngineConfig:
    return EngineConfig.from_flat({"model": QWEN3_NEXT, "gpu": "H200"} | options)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_linear.py --align: vLLM 0.33's scheduler with MambaSpec
    groups in mamba_cache_mode "align" beside a full-attention group, pools that fill up, prompts
    that share prefixes: every step's scheduled tokens, running, waiting and blocks in use, every
    request's first-token and finish step, and the prefix cache's queried and hit tokens."""
    case = _rooted(CASES[index])
    assert case["case"]["mamba_cache_mode"] == "align" and case["case"]["opts"]["enable_prefix_caching"]
    ours = assert_same_steps_as_vllm(case)
    assert max(row[3] for row in ours["steps"]) == case["case"]["opts"]["num_gpu_blocks"] - 1  # (the pool filled)
    stats = ours["scheduler"].kv_cache_manager.prefix_cache_stats
    assert [stats.queries, stats.hits] == case["vllm"]["prefix"] and stats.hits > 0


@pytest.mark.parametrize("index", range(len(ASYNC_CASES)))
def test_same_steps_as_vllm_async(index):
    """Recorded cases of scripts/oracle_spec_async.py --align: vLLM 0.33's AsyncScheduler, two
    batches deep, over Mamba groups in mode "align": a state is given back only once the step
    past it was processed (vLLM's num_in_flight_tokens). Steps, requests, prefix-cache counts."""
    case = _rooted(ASYNC_CASES[index])
    assert case["case"]["mamba_cache_mode"] == "align" and case["case"]["opts"]["async_scheduling"]
    ours = assert_same_async_spec_steps_as_vllm(case)
    assert max(row[3] for row in ours["steps"]) == case["case"]["opts"]["num_gpu_blocks"] - 1  # (the pool filled)
    assert case["vllm"]["prefix"][1] > 0


@pytest.mark.parametrize("index", range(len(SPEC_CASES)))
def test_same_steps_as_vllm_with_drafts(index):
    """Recorded cases of scripts/oracle_linear.py --align --speculative: ngram or MTP drafts on
    Mamba groups in mode "align", K scratch state blocks after each running state (vLLM's
    num_speculative_blocks, relocated when the tokens jump past them), MTP's lookahead block
    keys, blocks cached when a step's sampled tokens arrive. Steps, requests, accepted drafts,
    prefix-cache counts."""
    case = _rooted(SPEC_CASES[index])
    opts = case["case"]["opts"]
    assert case["case"]["mamba_cache_mode"] == "align" and opts["speculative_method"] in ("ngram", "mtp")
    ours = assert_same_steps_as_vllm(case)
    assert max(row[3] for row in ours["steps"]) == opts["num_gpu_blocks"] - 1  # (the pool filled)
    sched = ours["scheduler"]
    assert sched.spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"] > 0
    stats = sched.kv_cache_manager.prefix_cache_stats
    assert [stats.queries, stats.hits] == case["vllm"]["prefix"] and stats.hits > 0


@pytest.mark.parametrize("index", range(len(SPEC_ASYNC_CASES)))
def test_same_steps_as_vllm_async_with_mtp(index):
    """Recorded cases of scripts/oracle_spec_async.py --align --linear: MTP drafts under async
    scheduling on Mamba groups in mode "align" (vLLM's AsyncScheduler, two batches deep)."""
    case = _rooted(SPEC_ASYNC_CASES[index])
    opts = case["case"]["opts"]
    assert opts["async_scheduling"] and opts["speculative_method"] == "mtp"
    ours = assert_same_async_spec_steps_as_vllm(case)
    assert max(row[3] for row in ours["steps"]) == opts["num_gpu_blocks"] - 1
    assert case["vllm"]["accepted"] > 0 and case["vllm"]["prefix"][1] > 0


def test_the_draft_cases_cover_both_methods_backends_and_every_retention():
    opts = [c["case"]["opts"] for c in SPEC_CASES]
    assert {o["speculative_method"] for o in opts} == {"ngram", "mtp"}
    assert {o["gdn_prefill_backend"] for o in opts} == {"flashinfer", "triton"}
    assert {o.get("prefix_cache_retention_interval") for o in opts} == {0, None, 128}
    assert len({o["model"] for o in opts}) == 4


def test_the_async_cases_cover_every_model_backend_and_retention():
    opts = [c["case"]["opts"] for c in ASYNC_CASES]
    assert len({o["model"] for o in opts}) == 4
    assert {o["gdn_prefill_backend"] for o in opts} == {"flashinfer", "triton"}
    assert {o.get("prefix_cache_retention_interval") for o in opts} == {0, None, 128}


def test_the_recorded_cases_cover_both_backends_and_every_retention():
    """The recorded cases span the three tiny models, prefill kernels with and without
    checkpoints inside a chunk, and retention 0 (boundaries only), None (every state) and 128."""
    opts = [c["case"]["opts"] for c in CASES]
    assert {Path(o["model"]).name for o in opts} == {"tiny_gdn_4x2.json", "tiny_gdn_8x4.json", "tiny_mamba2_10x5.json",
                                                     "tiny_nemotron_h.json"}
    assert {c["case"]["mamba_prefill_checkpoints"] for c in CASES} == {True, False}
    assert {o["prefix_cache_retention_interval"] for o in opts} == {0, None, 128}


@pytest.mark.parametrize("start, num_new, prompt, budget, checkpoints, junction, expected", [
    (0, 100, 300, 8192, False, 0, 96),  # (a chunk short of the prefill's end ends on a boundary)
    (0, 300, 300, 8192, False, 0, 288),  # (the last chunk stops at the last cacheable boundary, 299 // 32 * 32)
    (288, 12, 300, 8192, False, 0, 12),  # (then computes the rest)
    (0, 300, 300, 8192, True, 0, 300),  # (a kernel that exports the state from inside the chunk runs to the end)
    (10, 50, 300, 8192, False, 0, 22),  # (a chunk that starts mid-block stops at the next boundary)
    (0, 20, 300, 8192, False, 0, 0),  # (less than a block left in the budget: nothing this step)
    (0, 20, 300, 16, False, 0, 20),  # (unless a block does not fit the prefill budget at all)
    (0, 300, 300, 8192, True, 130, 128),  # (never past the junction, floored to a block)
    (300, 1, 300, 8192, False, 0, 1),  # (a decode is not cut)
])
def test_block_aligned_split(start, num_new, prompt, budget, checkpoints, junction, expected):
    """vLLM's _mamba_block_aligned_split at block size 32 for a 300-token prompt: a state is
    written only where a chunk ends, so chunks end where states are to be cached."""
    assert mamba_block_aligned_split(start, num_new, prompt, prompt, 32, budget, checkpoints, junction) == expected


def test_checkpoint_position_and_export():
    """The state a prefill can checkpoint is at the last boundary that leaves a token to compute;
    a chunk that holds it exports it only if it starts on a boundary a block or more before it."""
    assert prefill_checkpoint_position(300, 32) == 288 and prefill_checkpoint_position(288, 32) == 256
    assert prefill_checkpoint_position(10, 32) == 0
    assert checkpoint_exportable(0, 300, 288, 32)
    assert not checkpoint_exportable(16, 300, 288, 32)  # (mid-block start)
    assert checkpoint_exportable(256, 300, 288, 32) and not checkpoint_exportable(288, 300, 288, 32)
    assert not checkpoint_exportable(0, 200, 288, 32)  # (not in the chunk)
    assert not checkpoint_exportable(0, 288, 288, 32)  # (the chunk ends on it: an ordinary state)


@pytest.mark.parametrize("tp, backend, block_size, checkpoints", [
    (2, "auto", 576, True),  # (FlashInfer on Hopper: 544 rounded up to a multiple of 64)
    (2, "triton", 544, False),  # (Triton's prefill writes no checkpoints: no alignment)
    (4, "auto", 320, True), (4, "triton", 272, False)])
def test_block_size_and_state_blocks_with_prefix_caching(tp, backend, block_size, checkpoints):
    """Qwen3-Next on an H200 with prefix caching: FlashInfer's Gated DeltaNet prefill exports
    checkpoints at multiples of 64 tokens, so vLLM aligns the block to 64; each Mamba group holds
    2 states a request (the step after a block boundary) and 1 more for a checkpoint."""
    config = _config(tensor_parallel_size=tp, gdn_prefill_backend=backend, max_model_len=32768)
    assert config.mamba_align and config.cache.block_size == block_size
    assert config.mamba_prefill_checkpoints == checkpoints
    assert config.state_blocks_per_group == 2 + checkpoints
    cap = compute_capacity(config)
    assert cap.blocks_per_request == -(-32768 // block_size) + 3 * (2 + checkpoints)
    assert cap.blocks_per_request == group_blocks_per_request(config, 32768, startup=True)
    off = _config(tensor_parallel_size=tp, gdn_prefill_backend=backend, max_model_len=32768,
                  enable_prefix_caching=False)
    assert not off.mamba_align and off.state_blocks_per_group == 1 and off.cache.block_size == {2: 544, 4: 272}[tp]


def test_mamba2_always_checkpoints():
    config = EngineConfig.from_flat({"model": str(ROOT / "tests/core/data/tiny_mamba2_10x5.json"), "gpu": "H200",
                                     "gdn_prefill_backend": "triton"})
    assert config.mamba_align and config.mamba_prefill_checkpoints and config.state_blocks_per_group == 3


def test_replays_with_and_without_prefix_caching():
    """Qwen3-Next at TP 4 on the bundled trace of 400 requests behind 10 shared prefixes, in a pool
    of 600 blocks that preempts: with prefix caching the shared prefixes hit, and a replay that
    jumps over decode runs equals one that steps every decode; without it nothing hits."""
    trace = read_trace(ROOT / "traces" / "req400_prefix10.parquet")
    on = assert_decode_runs_change_nothing(trace, _config(tensor_parallel_size=4, num_gpu_blocks=600, max_model_len=8192))
    off = assert_decode_runs_change_nothing(trace, _config(tensor_parallel_size=4, num_gpu_blocks=600, max_model_len=8192,
                                                           enable_prefix_caching=False))
    assert on.summary["num_finished"] == off.summary["num_finished"] == 400
    assert on.summary["num_preemptions"] > 0
    assert on.summary["prefix_cache_hit_rate"] > 0.1 and off.summary["prefix_cache_hit_rate"] == 0
    linear = on.summary["kv_cache_groups"]["linear_attention"]
    assert linear == {"kind": "gated_deltanet", "state_bytes_per_layer": 274432, "state_blocks_per_request": 9,
                      "page_bytes_per_layer": 320 * 1024, "mamba_cache_mode": "align", "prefill_checkpoints": True}


def test_async_replays_with_prefix_caching():
    """Async scheduling with prefix caching on Qwen3-Next at TP 4: a replay that jumps over decode
    runs equals one that steps every decode, the shared prefixes hit as they do without async
    scheduling, and the pool's preemptions happen."""
    trace = read_trace(ROOT / "traces" / "req400_prefix10.parquet")
    options = dict(tensor_parallel_size=4, num_gpu_blocks=600, max_model_len=8192)
    res = assert_decode_runs_change_nothing(trace, _config(async_scheduling=True, **options))
    sync = assert_decode_runs_change_nothing(trace, _config(**options))
    assert res.summary["num_finished"] == 400 and res.summary["num_preemptions"] > 0
    assert abs(res.summary["prefix_cache_hit_rate"] - sync.summary["prefix_cache_hit_rate"]) < 0.05
    assert res.summary["prefix_cache_hit_rate"] > 0.1


def test_cli_picks_the_prefill_backend(tmp_path):
    """`--gdn-prefill-backend triton` on an H200: no checkpoints inside prefill chunks, so no
    64-token alignment (272-token blocks at TP 4) and 2 state blocks a group; summary.json and the
    report say which."""
    from click.testing import CliRunner

    from simkv.cli.main import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["replay", str(ROOT / "traces" / "req400_prefix10.parquet"), "--model", QWEN3_NEXT,
                                       "--gpu", "H200", "-tp", "4", "--max-model-len", "8192", "--gdn-prefill-backend",
                                       "triton", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["block_size"] == 272 and summary["config"]["gdn_prefill_backend"] == "triton"
    linear = summary["kv_cache_groups"]["linear_attention"]
    assert linear["state_blocks_per_request"] == 6 and not linear["prefill_checkpoints"]
    assert "no checkpoints inside prefill chunks" in (out / "report.html").read_text()


def test_capacity_layouts_say_each_layouts_block_size():
    """`simkv capacity --layouts 4` on Qwen3-Next: the block grows with the state a GPU holds, so
    each layout's row says its own block size (576 tokens at TP 1 and 2, 320 at TP 4 with prefix
    caching; 544 and 272 without), in the JSON and the table."""
    from click.testing import CliRunner

    from simkv.cli.main import main

    args = ["capacity", "--model", QWEN3_NEXT, "--gpu", "H200", "--layouts", "4", "--max-model-len", "32768"]
    for extra, sizes in (([], {1: 576, 2: 576, 4: 320}), (["--no-enable-prefix-caching"], {1: 544, 2: 544, 4: 272})):
        res = CliRunner().invoke(main, args + extra + ["--json"])
        assert res.exit_code == 0, res.output
        rows = [r for r in json.loads(res.output)["layouts"] if r["fits"]]
        assert {r["tensor_parallel_size"]: r["block_size"] for r in rows} == sizes
    table = CliRunner().invoke(main, args + ["--no-enable-prefix-caching"], env={"COLUMNS": "200"})
    assert "29,391 (272 tokens)" in table.output and "(544 tokens)" in table.output


def test_a_deferred_free_gives_every_group_back_at_once():
    """P/D under async scheduling fences frees (core/remote_kv.py): a deferred `free` keeps the
    request's attention blocks and states out of the pool until `free_deferred`, then returns
    all of them, null entries skipped."""
    from simkv.core.mamba_align import MambaAlignCoordinator
    from tests.core.helpers import make_request

    kv = MambaAlignCoordinator(40, 16, 256, (True, True, False))
    request = make_request(0, 70, 4)
    assert kv.allocate_slots(request, 0, 70)
    free_before = kv.block_pool.get_num_free_blocks()
    held = kv.num_blocks_of(request)
    assert held == 5 + 2  # 5 attention blocks, one state per Mamba group where the 70 tokens end
    deferred: list = []
    kv.free(request, 70, finished=True, defer=deferred)
    assert kv.block_pool.get_num_free_blocks() == free_before and kv.num_blocks_of(request) == 0
    assert len(deferred) == 1 and len(deferred[0]) == held
    kv.free_deferred(deferred[0])
    assert kv.block_pool.get_num_free_blocks() == free_before + held
