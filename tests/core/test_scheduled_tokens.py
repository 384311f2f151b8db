"""vLLM's max_num_scheduled_tokens: the scheduler's token budget of a step, beside
max_num_batched_tokens, which stays the batch's rows (the scheduled tokens and a draft model's
drafting slots)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simkv.config import ConfigError, EngineConfig
from simkv.core.scheduler import Scheduler
from tests.core.helpers import assert_same_async_spec_steps_as_vllm, assert_same_steps_as_vllm, make_request

RECORDED = json.loads((Path(__file__).parent / "data" / "scheduled_tokens_vllm_cases.json").read_text())


def _scheduler(**opts) -> Scheduler:
    flat = dict(num_gpu_blocks=200, block_size=16, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8) | opts
    return Scheduler(EngineConfig.from_flat(flat), flat["num_gpu_blocks"])


def test_a_prefill_chunk_takes_the_token_budget():
    """A 100-token prompt: 64 tokens a step with the batch's rows alone, 40 under a token budget of 40."""
    firsts = []
    for budget in (None, 40):
        sched = _scheduler(max_num_scheduled_tokens=budget)
        sched.add_request(make_request(0, 100, 4))
        firsts.append(sched.schedule().chunks[0].num_new_tokens)
    assert firsts == [64, 40]


def test_decoders_leave_the_token_budget_to_admissions():
    """Four decoders and a token budget of 10 leave 6 tokens of a waiting prompt for the step (the
    batch's 64 rows would leave 60)."""
    sched = _scheduler(max_num_scheduled_tokens=10)
    for i in range(4):
        sched.add_request(make_request(i, 2, 20))
    sched.update_from_output(sched.schedule())
    sched.add_request(make_request(9, 50, 4))
    out = sched.schedule()
    assert [c.num_new_tokens for c in out.chunks if c.request.index == 9] == [6]


def test_drafting_slots_take_rows_and_tokens_take_the_budget():
    """A draft model, K = 3: each decode is 4 tokens and 1 row more. 24 rows fit four (20 rows),
    but a token budget of 12 only three; with 60 rows and 12 tokens, still three."""
    counts = []
    for rows, budget in ((24, None), (24, 12), (60, 12)):
        sched = _scheduler(max_num_batched_tokens=rows, max_num_scheduled_tokens=budget, speculative_method="draft_model",
                           spec_draft_model="tiny-llama", num_speculative_tokens=3, spec_acceptance_rate=0.0)
        for i in range(4):
            sched.add_request(make_request(i, 2, 20))
        sched.update_from_output(sched.schedule())
        counts.append(len(sched.schedule().chunks))
    assert counts == [4, 3, 3]


def test_bad_values_and_summary_configs():
    with pytest.raises(ConfigError, match="max_num_scheduled_tokens must be >= 1"):
        EngineConfig.from_flat(dict(max_num_scheduled_tokens=0))
    assert "max_num_scheduled_tokens" not in EngineConfig.from_flat({}).to_dict()
    assert EngineConfig.from_flat(dict(max_num_scheduled_tokens=4096)).to_dict()["max_num_scheduled_tokens"] == 4096


@pytest.mark.parametrize("index", range(3))
def test_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec.py --scheduled-tokens (ngram, a draft model, eagle)."""
    case = RECORDED["sync"][index]
    assert case["case"]["opts"]["max_num_scheduled_tokens"] < case["case"]["opts"]["max_num_batched_tokens"]
    assert_same_steps_as_vllm(case)


@pytest.mark.parametrize("index", range(2))
def test_same_steps_as_vllm_async(index):
    """Recorded cases of scripts/oracle_spec_async.py --scheduled-tokens (chunked prefill on and off)."""
    assert_same_async_spec_steps_as_vllm(RECORDED["async"][index])


@pytest.mark.parametrize("index", range(3))
def test_same_steps_as_vllm_under_pd(index):
    """Recorded cases of scripts/oracle_pd.py --speculative --scheduled-tokens: two without drafts
    (steady decoders, chunked prefill off and on) and one with eagle."""
    from tests.core.test_remote_kv import _assert_same_as_recorded

    _assert_same_as_recorded(RECORDED["pd"][index])


def test_decode_runs_are_the_steps_under_a_token_budget():
    """Jumping over decode runs gives every step and count of stepping one by one when the token
    budget (24) is below the rows (64): the decoders use it up, so the waiting prompts wait."""
    from tests.core.helpers import drive

    results = []
    for use_runs in (False, True):
        sched = _scheduler(max_num_scheduled_tokens=24, num_gpu_blocks=400)
        for i in range(30):
            sched.add_request(make_request(i, 20 + 7 * i, 30 + (i % 5) * 9))
        results.append(drive(sched, use_runs=use_runs))
    assert results[0] == results[1]
    assert results[0]["steps"] > 0
