"""Swap preemption (vLLM v0's SWAP mode): KV moves to CPU swap space and back, nothing is lost."""

import json

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.cli.main import main
from simkv.core.request import RequestStatus
from simkv.core.scheduler import Scheduler
from tests.core.helpers import drive, make_config, make_request


def _swap_scheduler(num_cpu_blocks: int, **kw) -> Scheduler:
    config = make_config(num_gpu_blocks=9, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=128,
                         preemption_mode="swap", **kw)
    return Scheduler(config, 9, num_cpu_blocks=num_cpu_blocks)


def _check_swap(sched: Scheduler) -> None:
    sched.kv_cache_manager.block_pool.check_invariants()
    swapped = [r for r in sched.waiting if r.swapped_blocks]
    assert sched.cpu_blocks_used == sum(r.swapped_blocks for r in swapped), "block lost between GPU and CPU"
    assert 0 <= sched.cpu_blocks_used <= sched.num_cpu_blocks
    assert sched.num_swapped == len(swapped)


def test_swapped_request_resumes_without_recompute():
    s = _swap_scheduler(num_cpu_blocks=16)
    reqs = [make_request(i, 32, 30) for i in range(4)]  # 8 usable blocks, 2 each, all grow to 4
    for r in reqs:
        s.add_request(r)
    out = drive(s, use_runs=False, check=_check_swap)
    assert s.num_swap_outs > 0 and s.total_swap_in_blocks == s.total_swap_out_blocks
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    # swapped requests resume where they were: every token is computed exactly once
    assert out["prefill_tokens"] + out["decode_tokens"] == 4 * 32 + 4 * 29


def test_recompute_when_swap_space_is_full():
    s = _swap_scheduler(num_cpu_blocks=0)
    for i in range(4):
        s.add_request(make_request(i, 32, 30))
    drive(s, use_runs=False, check=_check_swap)
    assert s.num_swap_outs == 0 and s.num_preemptions > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 100), st.integers(1, 40)), min_size=1, max_size=12),
       st.integers(0, 20), st.booleans(), st.sampled_from(["newest", "requester"]))
def test_no_block_lost_between_gpu_and_cpu(reqs, cpu_blocks, runs, victim):
    s = _swap_scheduler(num_cpu_blocks=cpu_blocks, preemption_victim=victim, enable_prefix_caching=False)
    config_blocks = 8
    assert config_blocks * 16 >= 128
    requests = [make_request(i, p, o) for i, (p, o) in enumerate(reqs)]
    for r in requests:
        s.add_request(r)
    drive(s, use_runs=runs, check=_check_swap)
    assert all(r.status == RequestStatus.FINISHED for r in requests)
    assert s.cpu_blocks_used == 0 and s.kv_cache_manager.block_pool.get_num_used_blocks() == 0


def test_swap_delays_steps_by_pcie_time(tmp_path):
    runner = CliRunner()
    base = ["replay", "traces/req400.parquet", "--num-gpu-blocks", "2000", "--max-model-len", "4096",
            "--cost-model", "linear", "--quiet"]
    r = runner.invoke(main, base + ["--preemption-mode", "swap", "--out", str(tmp_path / "swap")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "swap" / "summary.json").read_text())
    assert s["num_swap_outs"] > 0 and s["swap_out_bytes"] == s["swap_in_bytes"] > 0
    assert s["peak_requests_swapped"] >= 1
    r = runner.invoke(main, base + ["--out", str(tmp_path / "recompute")])
    assert r.exit_code == 0, r.output
    s2 = json.loads((tmp_path / "recompute" / "summary.json").read_text())
    assert s2["num_swap_outs"] == 0 and s2["num_preemptions"] > 0
    assert s["num_prefill_tokens"] < s2["num_prefill_tokens"]  # swapping saves the recompute
