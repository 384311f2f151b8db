"""vLLM 0.33's admission limit (`max_num_active_seqs`) and local prefill cadence
(`prefill_schedule_interval`) in the engine core (docs/semantics.md#admission-limit-and-prefill-cadence).

The recorded cases come from the real vLLM 0.33 scheduler (`scripts/oracle_cadence.py --save`)."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from simkv.config import ConfigError, EngineConfig
from simkv.core.scheduler import Scheduler
from simkv.replay.api import replay
from simkv.traces.schema import read_trace, take_rows
from tests.cli_runs import cli_fails
from tests.core.helpers import (assert_decode_runs_change_no_bytes, assert_same_async_spec_steps_as_vllm,
                                assert_same_steps_as_vllm, count_failing, make_request)

DATA = Path(__file__).parent / "data" / "cadence_vllm_cases.json"
ASYNC_DATA = Path(__file__).parent / "data" / "cadence_async_vllm_cases.json"


def _cases() -> list[dict]:
    return json.loads(DATA.read_text())["cases"]


@pytest.mark.parametrize("index", range(8))
def test_same_steps_as_vllm(index: int) -> None:
    """Intervals 2 to 4, admission limits below max_num_seqs, with and without speculative
    decoding: every step's tokens, running, waiting and blocks, every request's first-token and
    finish step."""
    assert_same_steps_as_vllm(_cases()[index])


@pytest.mark.parametrize("index", range(10))
def test_same_steps_as_vllm_async(index: int) -> None:
    """The same under vLLM's AsyncScheduler two batches deep (EAGLE or a draft model in most):
    every step, request, accepted draft and prefix-cache count."""
    assert_same_async_spec_steps_as_vllm(json.loads(ASYNC_DATA.read_text())["cases"][index])


def test_async_cases_need_the_requests_whose_last_token_is_in_flight(monkeypatch) -> None:
    """A request whose last token is in flight still decodes: not counting it lets prefill in
    where vLLM holds it back."""
    monkeypatch.setattr(Scheduler, "_holds_prefill", lambda self: (
        not self._prefill_capacity_bound
        and self._num_executed_steps + 1 - self._last_prefill_step < self.prefill_interval
        and (self._num_decoders > 0 or any(not r.prefill_chunk for r in self._prefilling))))
    broken = count_failing(assert_same_async_spec_steps_as_vllm, json.loads(ASYNC_DATA.read_text())["cases"])
    assert broken >= 2, broken


def _broken(monkeypatch=None, **opts) -> int:
    def with_opts(recorded: dict) -> None:
        recorded = copy.deepcopy(recorded)
        recorded["case"]["opts"] |= opts
        assert_same_steps_as_vllm(recorded)

    return count_failing(with_opts, _cases())


def test_recorded_cases_depend_on_each_rule(monkeypatch) -> None:
    """No admission limit, no cadence, and a cadence without its capacity-bound escape each break
    recorded cases."""
    unlimited = _broken(max_num_active_seqs=None)
    no_cadence = _broken(prefill_schedule_interval=1)
    monkeypatch.setattr(Scheduler, "_holds_prefill", lambda self: (
        self._num_executed_steps + 1 - self._last_prefill_step < self.prefill_interval
        and (self._num_decoders > 0 or any(not r.prefill_chunk for r in self._prefilling))))
    no_escape = _broken()
    assert (unlimited, no_cadence, no_escape) >= (3, 6, 3), (unlimited, no_cadence, no_escape)


def _scheduler(**opts) -> Scheduler:
    flat = dict(num_gpu_blocks=200, block_size=4, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8) | opts
    return Scheduler(EngineConfig.from_flat(flat), flat["num_gpu_blocks"])


def _run(sched: Scheduler, arrivals: dict[int, list]) -> list[tuple[int, int]]:
    """(prefill tokens, decodes) per step, requests added at their step."""
    rows = []
    step = 0
    while sched.has_unfinished_requests() or any(k >= step for k in arrivals):
        for request in arrivals.get(step, []):
            sched.add_request(request)
        out = sched.schedule()
        rows.append((sum(c.num_new_tokens for c in out.chunks), out.num_decode_reqs))
        sched.update_from_output(out)
        step += 1
    return rows


def test_a_prompt_waits_for_the_step_that_carries_prefill() -> None:
    """Interval 3: request 0's prompt runs at step 0 (nothing decodes yet); request 1 arrives at
    step 1 and waits while 0 decodes alone, until 3 steps have passed since step 0; its second
    chunk waits again."""
    sched = _scheduler(prefill_schedule_interval=3)
    rows = _run(sched, {0: [make_request(0, 10, 12)], 1: [make_request(1, 100, 4)]})
    assert rows[:8] == [(10, 0), (0, 1), (0, 1), (63, 1), (0, 1), (0, 1), (37, 1), (0, 2)]
    assert _run(_scheduler(), {0: [make_request(0, 10, 12)], 1: [make_request(1, 100, 4)]})[:4] == [
        (10, 0), (63, 1), (37, 1), (0, 2)]


def test_max_num_active_seqs_caps_running_below_max_num_seqs() -> None:
    sched = _scheduler(max_num_active_seqs=2)
    for i in range(5):
        sched.add_request(make_request(i, 4, 3))
    out = sched.schedule()
    assert len(out.chunks) == 2 and len(sched.running) == 2 and sched.max_num_seqs == 8


def _slice():
    return take_rows(read_trace("traces/azure_conv_slice.parquet"), np.arange(300))


@pytest.mark.parametrize("options", [{"prefill_schedule_interval": 4}, {"max_num_active_seqs": 8},
                                     {"prefill_schedule_interval": 3, "max_num_active_seqs": 16,
                                      "num_gpu_blocks": 900},
                                     {"prefill_schedule_interval": 4, "async_scheduling": True}],
                         ids=["interval", "active", "both-preempting", "interval-async"])
def test_decode_runs_change_no_bytes(options, tmp_path) -> None:
    res = assert_decode_runs_change_no_bytes(_slice(), EngineConfig.from_flat(options), tmp_path)
    base = replay(_slice(), EngineConfig.from_flat({k: v for k, v in options.items()
                                                    if k in ("num_gpu_blocks", "async_scheduling")}))
    assert res.summary["ttft_s"]["mean"] > base.summary["ttft_s"]["mean"]  # (held prompts, or a smaller batch)
    if "max_num_active_seqs" in options:
        assert res.summary["peak_running"] <= options["max_num_active_seqs"]


@pytest.mark.parametrize("options, message", [
    ({"max_num_active_seqs": 2000}, r"max_num_active_seqs \(2000\) must be >= 1 and cannot be greater than max_num_seqs"),
    ({"prefill_schedule_interval": 0}, "prefill_schedule_interval must be >= 1"),
    ({"prefill_schedule_interval": 2, "parallel_sampling": "fork"}, "forked parallel sampling"),
])
def test_bad_options(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(options)


def test_data_parallel_ranks_follow_the_groups_cadence() -> None:
    """On a data-parallel rank the local cadence is off; the DP engine core's throttle (set by
    the replay before each schedule()) holds prefill back while a decode runs, until a release
    step leaves requests waiting."""
    config = EngineConfig.from_flat({"model": "qwen3-30b-a3b", "gpu": "H200", "data_parallel_size": 2,
                                     "prefill_schedule_interval": 4, "max_num_batched_tokens": 64,
                                     "max_num_seqs": 8, "block_size": 4})
    sched = Scheduler(config, 400)
    assert sched.prefill_interval == 1 and sched.dp_cadence
    sched.add_request(make_request(0, 10, 12))
    sched.throttle_prefills = True  # (nothing decodes yet: the prompt goes all the same)
    out = sched.schedule()
    sched.update_from_output(out)
    assert out.total_num_scheduled_tokens == 10
    sched.add_request(make_request(1, 100, 4))
    out = sched.schedule()  # (throttled, a decode runs: the new prompt waits)
    sched.update_from_output(out)
    assert (out.total_num_scheduled_tokens, len(sched.waiting)) == (1, 1)
    sched.throttle_prefills = False  # (a step on the cadence: it goes, and leaves nothing waiting)
    out = sched.schedule()
    sched.update_from_output(out)
    assert out.total_num_scheduled_tokens == 64 and not sched.waiting
    sched.throttle_prefills = True  # (its next chunk waits)
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 1


def test_data_parallel_cadence_trades_ttft_for_tpot() -> None:
    """DeepSeek-V3 on 8 data-parallel ranks at 2x the Azure slice's rate: aligning prefill on
    every 8th step lengthens TTFT and shortens the worst TPOT."""
    from dataclasses import replace

    trace = read_trace("traces/azure_conv_slice.parquet")
    trace = take_rows(replace(trace, arrival_time_s=trace.arrival_time_s / 2), np.arange(600))
    base = {"model": "deepseek-v3", "gpu": "H200", "data_parallel_size": 8}
    free = replay(trace, EngineConfig.from_flat(base))
    held = replay(trace, EngineConfig.from_flat(base | {"prefill_schedule_interval": 8}))
    assert held.summary["ttft_s"]["p50"] > 2 * free.summary["ttft_s"]["p50"]
    assert held.summary["tpot_s"]["p99"] < free.summary["tpot_s"]["p99"]


def test_pd_pools_never_hold_prefill_back(tmp_path) -> None:
    """P/D: the cadence holds nothing back in either pool. The prefill pool runs no decode (its
    requests stop at their first token), and the decode pool admits pulled requests with one
    token left, which a held step lets in. Same requests, same times; decode runs change no
    byte."""
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = _slice()
    held = assert_decode_runs_change_no_bytes(trace, EngineConfig.from_flat({"prefill_schedule_interval": 4}),
                                              tmp_path, disaggregation=DisaggregationSpec(1, 1))
    free = replay(trace, EngineConfig.from_flat({}), disaggregation=DisaggregationSpec(1, 1))
    assert held.requests.equals(free.requests)


def test_lora_skips_are_set_aside(tmp_path) -> None:
    """LoRA: a request passed over for want of an adapter slot is set aside (vLLM's
    deferred_waiting) and does not make the engine capacity-bound; the replay steps while
    requests wait (decode runs change no byte), and the cadence holds prompts back."""
    from simkv.traces.lora import assign_adapters

    trace = assign_adapters(_slice(), 6, 1.0, seed=3)
    options = {"enable_lora": True, "max_loras": 2}
    held = assert_decode_runs_change_no_bytes(trace, EngineConfig.from_flat(options | {"prefill_schedule_interval": 4}),
                                              tmp_path)
    free = replay(trace, EngineConfig.from_flat(options))
    assert held.summary["ttft_s"]["p50"] > free.summary["ttft_s"]["p50"]


PD_DATA = Path(__file__).parent / "data" / "cadence_pd_vllm_cases.json"
OFFLOAD_DATA = Path(__file__).parent / "data" / "cadence_offload_vllm_cases.json"


@pytest.mark.parametrize("index", range(7))
def test_offload_same_steps_as_vllm(index: int) -> None:
    """Recorded cases of scripts/oracle_cadence.py --offload (a CPU tier through vLLM's
    OffloadingConnector: loads wait set aside, lookups to retry are skipped): every step,
    request and transfer."""
    from tests.core.helpers import assert_offload_as_recorded

    assert_offload_as_recorded(json.loads(OFFLOAD_DATA.read_text())["cases"][index])


@pytest.mark.parametrize("index", range(6))
def test_pd_same_steps_as_vllm(index: int) -> None:
    """Recorded P/D cases of scripts/oracle_cadence.py --pd (pulls and sends through vLLM's KV
    connector, with the cadence and the admission limit): every step and request."""
    from tests.core.helpers import drive_pd

    recorded = json.loads(PD_DATA.read_text())["cases"][index]
    ours, theirs = drive_pd(recorded["case"]), recorded["vllm"]
    steps = list(theirs["steps"])
    while steps and not any(steps[-1]):
        steps.pop()
    assert ours["steps"] == steps
    assert ours["requests"] == theirs["requests"]


def test_cli_flags() -> None:
    out = cli_fails(["replay", "traces/req400.parquet", "--max-num-seqs", "8", "--max-num-active-seqs", "9"])
    assert "cannot be greater than max_num_seqs (8)" in out
