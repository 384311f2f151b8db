"""Speculative decoding in the engine core (simkv/core/spec_decode.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simkv.config import ConfigError, EngineConfig, SpeculativeConfig
from simkv.core.scheduler import Scheduler
from simkv.core.spec_decode import AcceptanceModel
from tests.core.helpers import (assert_same_async_spec_steps_as_vllm, assert_same_steps_as_vllm, count_failing,
                                k_drafts_at_every_match, drive_steps, drive_steps_async,
                                drive_steps_pipeline,
                                make_request)

DATA = Path(__file__).parent / "data" / "spec_vllm_cases.json"
ASYNC_DATA = Path(__file__).parent / "data" / "spec_async_vllm_cases.json"


def _spec_scheduler(blocks=64, method="ngram", k=3, rate=1.0, **opts):
    flat = dict(num_gpu_blocks=blocks, block_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8,
                speculative_method=method, num_speculative_tokens=k, spec_acceptance_rate=rate) | opts
    if method == "draft_model":
        flat["spec_draft_model"] = "tiny-llama"
    return Scheduler(EngineConfig.from_flat(flat), blocks)


@pytest.mark.parametrize("index", range(6))
def test_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec.py (eagle with shared prompts and preemptions, a
    draft model, ngram under fcfs and priority; eagle and a draft model with dynamic speculation
    lengths): vLLM 0.33's scheduler's every step and every request's first-token and finish step."""
    case = json.loads(DATA.read_text())["cases"][index]
    ours = assert_same_steps_as_vllm(case)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]


@pytest.mark.parametrize("index", range(8))
def test_same_steps_as_vllm_async(index):
    """Recorded cases of scripts/oracle_spec_async.py (vLLM 0.33's AsyncScheduler two batches deep:
    eagle and draft models, fcfs and priority, chunked prefill on and off, dynamic speculation,
    up to 20 preemptions of requests with a step in flight): every step, every request's
    first-token and finish step, the accepted drafts and the prefix-cache counts."""
    recorded = json.loads(ASYNC_DATA.read_text())["cases"][index]
    assert_same_async_spec_steps_as_vllm(recorded)


ABORT_DATA = Path(__file__).parent / "data" / "spec_abort_vllm_cases.json"
ABORT_ASYNC_DATA = Path(__file__).parent / "data" / "spec_abort_async_vllm_cases.json"


def _recorded_aborts(path):
    return json.loads(path.read_text())["cases"]


@pytest.mark.parametrize("index", range(len(_recorded_aborts(ABORT_DATA))))
def test_aborts_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec.py --aborts: a front end aborts a third of the
    requests (clients that gave up), before a step is scheduled or after it ran and before its
    output is processed; drafts in flight are dropped with the request, its verified blocks stay
    cached. Every step, request and accepted draft as vLLM 0.33's."""
    recorded = _recorded_aborts(ABORT_DATA)[index]
    ours = assert_same_steps_as_vllm(recorded)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == recorded["vllm"]["accepted"]
    assert ours["aborted"] > 0


@pytest.mark.parametrize("index", range(len(_recorded_aborts(ABORT_ASYNC_DATA))))
def test_aborts_same_steps_as_vllm_async(index):
    """Recorded cases of scripts/oracle_spec_async.py --aborts: aborts under vLLM's AsyncScheduler,
    taken before the next step is scheduled or before a step's output is processed, the next step
    in flight: the aborted request's output is skipped and its cached blocks are those vLLM
    had cached (not its placeholders')."""
    recorded = _recorded_aborts(ABORT_ASYNC_DATA)[index]
    assert assert_same_async_spec_steps_as_vllm(recorded)["aborted"] > 0


def test_recorded_aborts_depend_on_where_aborts_are_taken_and_on_skipping_their_output(monkeypatch):
    """Two mutations, each must break recorded cases: every abort taken before its step is
    scheduled (none between a step and its output), and an async step's output processed for a
    request aborted while it ran."""
    import copy

    import simkv.core.spec_decode as spec_decode
    from simkv.core.request import RequestStatus

    def breaks(cases, check) -> int:
        n = 0
        for recorded in cases:
            try:
                check(recorded)
            except Exception:  # (a mutated engine may differ, or trip over its own state)
                n += 1
        return n

    def early(recorded):
        recorded = copy.deepcopy(recorded)
        for abort in recorded["case"]["aborts"]:
            abort["when"] = "before"
        return recorded

    sync, async_ = _recorded_aborts(ABORT_DATA), _recorded_aborts(ABORT_ASYNC_DATA)
    assert breaks([early(r) for r in sync], assert_same_steps_as_vllm) == len(sync)
    assert breaks([early(r) for r in async_], assert_same_async_spec_steps_as_vllm) == len(async_)

    class OutputOfAborted:  # (the aborted status no longer recognised when an output arrives)
        RUNNING, FINISHED, ABORTED = RequestStatus.RUNNING, RequestStatus.FINISHED, -1

    monkeypatch.setattr(spec_decode, "RequestStatus", OutputOfAborted)
    assert breaks(async_, assert_same_async_spec_steps_as_vllm) >= 5


def _drive_async_by_hand(sched) -> list[int]:
    """Async order (S0, S1, U0, S2, U1, ...) for requests added up front: the tokens of each step."""
    scheduled, in_flight = [], None
    while sched.has_unfinished_requests() or in_flight is not None:
        out = sched.schedule() if sched.has_unfinished_requests() else None
        if out is not None and not out.is_empty:
            scheduled.append(out.total_num_scheduled_tokens)
        else:
            out = None
        if in_flight is not None:
            sched.update_from_output(in_flight)
        in_flight = out
    return scheduled


def test_async_all_drafts_accepted_by_hand():
    """As test_all_drafts_accepted_by_hand under async scheduling: step 1 schedules 1 + 3 tokens
    while the prefill is still running (its token and drafts are placeholders). The request
    finishes in step 2's output as before, but step 3 was scheduled before that output arrived
    (a step of 4 placeholders could have been needed had drafts been rejected): a wasted step."""
    sched = _spec_scheduler(method="eagle", rate=1.0, async_scheduling=True)
    req = make_request(0, 10, 8)
    sched.add_request(req)
    assert _drive_async_by_hand(sched) == [10, 4, 4, 4]
    assert req.finish_step == 2 and req.num_output_tokens == 8
    assert sched.spec_stats["num_accepted_tokens"] == 3 + 3
    assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0


def test_async_rejections_roll_back_on_arrival():
    """Acceptance 0 under async scheduling: every step keeps one token; the request whose step
    in flight is sure to sample its last token (even with every draft rejected) is not scheduled
    again, so no step is wasted: 8 outputs in the outputs of steps 0-7."""
    sched = _spec_scheduler(method="eagle", rate=0.0, async_scheduling=True)
    req = make_request(0, 10, 8)
    sched.add_request(req)
    assert _drive_async_by_hand(sched) == [10] + [4] * 7
    assert req.finish_step == 7 and req.num_output_tokens == 8
    assert req.num_output_placeholders == 0 and req.num_in_flight_tokens == 0


def test_all_drafts_accepted_by_hand():
    """Prompt 10, 8 outputs, K=3, every draft accepted: the prefill samples 1 token, then each
    step schedules 1 + 3 tokens and keeps 4; the last step stops at max_tokens."""
    sched = _spec_scheduler(rate=1.0)
    sched.add_request(make_request(0, 10, 8))
    scheduled, outputs = [], []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        scheduled.append(out.total_num_scheduled_tokens)
        sched.update_from_output(out)
        outputs.append(sched.running[0].num_output_tokens if sched.running else 8)
    assert scheduled == [10, 4, 4]
    assert outputs == [1, 5, 8]
    # both verifies accepted their 3 drafts; the last one kept 3 of its 4 tokens (max_tokens)
    assert sched.spec_stats["num_accepted_tokens"] == 3 + 3


def test_no_draft_accepted_rolls_back():
    """Acceptance 0: every step verifies 3 drafts and keeps only the bonus token; the computed
    tokens fall back to one short of the request's tokens after every step."""
    sched = _spec_scheduler(rate=0.0)
    req = make_request(0, 10, 5)
    sched.add_request(req)
    computed = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.num_verify_tokens == (0 if out.step == 0 else 4)
        assert out.num_draft_tokens == (0 if out.step == 0 else 3)
        sched.update_from_output(out)
        computed.append(req.num_computed_tokens)
    assert computed == [10, 11, 12, 13, 14]  # prompt + outputs - 1, the last one stopped
    assert req.finish_step == 4
    assert sched.spec_stats["num_draft_tokens"] == 12 and sched.spec_stats["num_accepted_tokens"] == 0


def test_budget_cuts_drafts():
    """Two decodes of 1 + 3 tokens: an 8-token budget takes both whole, a 6-token one leaves the
    second 2 tokens: its last sampled token and 1 draft."""
    sched = _spec_scheduler(rate=0.0, max_num_batched_tokens=8, max_num_seqs=2)
    for i in range(2):
        sched.add_request(make_request(i, 3, 10))
    sched.update_from_output(sched.schedule())  # both prefills (6 tokens)
    out = sched.schedule()
    assert [(c.num_new_tokens, c.num_spec_tokens) for c in out.chunks] == [(4, 3), (4, 3)]
    sched2 = _spec_scheduler(rate=0.0, max_num_batched_tokens=6, max_num_seqs=2)
    for i in range(2):
        sched2.add_request(make_request(i, 3, 10))
    sched2.update_from_output(sched2.schedule())
    out = sched2.schedule()
    assert [(c.num_new_tokens, c.num_spec_tokens) for c in out.chunks] == [(4, 3), (2, 1)]


def test_draft_model_takes_a_batch_row_per_request():
    """vLLM's input budget: a draft model's request takes its tokens plus one row; with a
    10-token budget two 1 + 3 decodes fit (8 + 2 rows) and a third does not."""
    sched = _spec_scheduler(method="draft_model", rate=0.0, max_num_batched_tokens=10, max_num_seqs=3)
    for i in range(3):
        sched.add_request(make_request(i, 2, 10))
    sched.update_from_output(sched.schedule())  # the three prefills: 6 tokens + 3 rows
    out = sched.schedule()
    assert [c.num_new_tokens for c in out.chunks] == [4, 4]


PARALLEL_DRAFTING_DATA = Path(__file__).parent / "data" / "spec_parallel_drafting_vllm_cases.json"


@pytest.mark.parametrize("index", range(6))
def test_parallel_drafting_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec.py --parallel-drafting (vLLM 0.33's parallel_drafting:
    eagle and draft models, K 2 to 5, two with dynamic speculation lengths), each one that differs
    from vLLM's steps when parallel drafting takes no extra batch slots: every step and request
    equal."""
    case = json.loads(PARALLEL_DRAFTING_DATA.read_text())["cases"][index]
    assert case["case"]["opts"]["spec_parallel_drafting"]
    ours = assert_same_steps_as_vllm(case)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]


DFLASH_DATA = Path(__file__).parent / "data" / "spec_dflash_vllm_cases.json"
DFLASH_ASYNC_DATA = Path(__file__).parent / "data" / "spec_dflash_async_vllm_cases.json"


@pytest.mark.parametrize("index", range(6))
def test_dflash_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec.py --dflash (vLLM 0.33's dflash method with a
    config-only DFlash drafter: K + 1 lookahead slots, no batch slots, no lookahead block keys,
    max_num_active_seqs capped at max_num_batched_tokens // (K + 1)): every step and request equal.
    Two of them differ without the cap, all six with K lookahead slots."""
    case = json.loads(DFLASH_DATA.read_text())["cases"][index]
    assert case["case"]["opts"]["speculative_method"] == "dflash"
    ours = assert_same_steps_as_vllm(case)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]


@pytest.mark.parametrize("index", range(2))
def test_dflash_same_steps_as_vllm_async(index):
    """Recorded cases of scripts/oracle_spec_async.py --dflash (vLLM 0.33's AsyncScheduler two
    batches deep, 35 and 27 preemptions): every step, request, accepted draft and prefix count."""
    assert_same_async_spec_steps_as_vllm(json.loads(DFLASH_ASYNC_DATA.read_text())["cases"][index])


def test_dflash_caps_the_running_requests():
    """vLLM's dflash check: K = 15 needs 16 query tokens per request, so 64 batched tokens admit
    4 requests however large max_num_seqs; the lookahead is K + 1 slots."""
    config = EngineConfig.from_flat(dict(speculative_method="dflash", num_speculative_tokens=15,
                                         max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128,
                                         num_gpu_blocks=200))
    assert config.max_num_active == 4 and config.num_lookahead_tokens == 16
    sched = Scheduler(config, 200)
    for i in range(6):
        sched.add_request(make_request(i, 8, 20))
    out = sched.schedule()
    assert len(out.chunks) == 4 and sched.num_waiting() == 2


@pytest.mark.parametrize("method, parallel, slots", [
    ("eagle", False, 0), ("eagle3", True, 2), ("draft_model", False, 1), ("draft_model", True, 3), ("mtp", False, 0)])
def test_draft_slots(method, parallel, slots):
    """vLLM's max_num_new_slots_for_drafting at K = 3: P-EAGLE K - 1, PARD K, a draft model 1."""
    spec = SpeculativeConfig(method, 3, spec_draft_model="tiny-llama" if method == "draft_model" else None,
                             spec_parallel_drafting=parallel)
    assert spec.draft_slots == slots


def test_parallel_drafting_takes_batch_slots():
    """EAGLE drafting in parallel, K = 3: each request takes 1 + 3 tokens and 2 more slots of the
    12-token input budget, so two decodes fit where drafting in turn fits three."""
    counts = []
    for parallel in (False, True):
        sched = _spec_scheduler(method="eagle", rate=0.0, max_num_batched_tokens=12, max_num_seqs=3,
                                spec_parallel_drafting=parallel)
        for i in range(3):
            sched.add_request(make_request(i, 2, 10))
        first = sched.schedule()
        sched.update_from_output(first)
        counts.append(([c.num_new_tokens for c in first.chunks], [c.num_new_tokens for c in sched.schedule().chunks]))
    assert counts == [([2, 2, 2], [4, 4, 4]), ([2, 2, 2], [4, 4])]


@pytest.mark.parametrize("length, rates", [(1.0, (0.0, 0.0, 0.0)), (2.5, (1.0, 0.5, 0.0)), (3.25, (1.0, 1.0, 0.25)),
                                           (4.0, (1.0, 1.0, 1.0))])
def test_acceptance_length_as_vllms_synthetic_sampler(length, rates):
    """vLLM's synthetic_acceptance_length spreads L - 1 accepted drafts over the positions with the
    least variance: the first floor(L - 1) always, the next with what is left; a replay's mean
    acceptance length is then L exactly (given room for every draft)."""
    spec = SpeculativeConfig("eagle", 3, spec_acceptance_length=length)
    assert spec.conditional_acceptance_rates == pytest.approx(rates)
    model = AcceptanceModel(spec.conditional_acceptance_rates, 7)
    mean = sum(model.num_accepted(i, 0, 3) for i in range(20_000)) / 20_000
    assert abs(1 + mean - length) < 0.01


def test_acceptance_model():
    never, always = AcceptanceModel((0.0,) * 4, 0), AcceptanceModel((1.0,) * 4, 0)
    assert never.num_accepted(5, 7, 4) == 0 and always.num_accepted(5, 7, 4) == 4
    alpha, k, n = 0.6, 3, 40_000
    model = AcceptanceModel((alpha,) * k, 1)
    mean = sum(model.num_accepted(i, 0, k) for i in range(n)) / n
    expected = alpha + alpha ** 2 + alpha ** 3
    assert abs(mean - expected) < 0.02
    other = AcceptanceModel((alpha,) * k, 2)
    assert [model.num_accepted(i, 3, k) for i in range(50)] != [other.num_accepted(i, 3, k) for i in range(50)]


NGRAM_MISS_DATA = Path(__file__).parent / "data" / "spec_ngram_miss_vllm_cases.json"


@pytest.mark.parametrize("index", range(8))
def test_ngram_misses_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec.py --ngram-misses (match rates 0, 0.3 and 0.7; K 1 to
    5): a request whose prompt lookup found no match proposes no drafts to vLLM 0.33's scheduler
    and decodes one token next; every step, request and accepted draft equal."""
    case = json.loads(NGRAM_MISS_DATA.read_text())["cases"][index]
    ours = assert_same_steps_as_vllm(case)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]


def test_recorded_ngram_misses_depend_on_proposing_none(monkeypatch):
    """Every recorded case has misses that change its steps: proposing K drafts after a miss
    breaks all eight."""
    monkeypatch.setattr(AcceptanceModel, "proposes", lambda self, index, position: True)
    cases = json.loads(NGRAM_MISS_DATA.read_text())["cases"]
    assert count_failing(assert_same_steps_as_vllm, cases) == len(cases)


DEVICE_NGRAM_DATA = Path(__file__).parent / "data" / "spec_ngram_device_vllm_cases.json"
DEVICE_NGRAM_ASYNC_DATA = Path(__file__).parent / "data" / "spec_ngram_device_async_vllm_cases.json"


@pytest.mark.parametrize("index", range(8))
def test_device_ngram_misses_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec.py --ngram-misses on vLLM's V2 model runner (its
    default; match rates 0, 0.3 and 0.7): the engine core is handed K placeholder drafts after
    every step whatever the lookup found, and a miss's drafts are all rejected; every step,
    request and accepted draft equal."""
    case = json.loads(DEVICE_NGRAM_DATA.read_text())["cases"][index]
    ours = assert_same_steps_as_vllm(case)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]


@pytest.mark.parametrize("index", range(8))
def test_device_ngram_async_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec_async.py --ngram-misses: ngram under async scheduling,
    which vLLM's V2 runner takes (its V1 runner refuses it)."""
    assert_same_async_spec_steps_as_vllm(json.loads(DEVICE_NGRAM_ASYNC_DATA.read_text())["cases"][index])


def test_recorded_device_ngram_cases_depend_on_misses_drafting(monkeypatch):
    """Proposing nothing after a miss (the V1 host proposer's way) breaks every recorded sync
    case, and accepting a miss's drafts breaks every async one."""
    sync = json.loads(DEVICE_NGRAM_DATA.read_text())["cases"]
    for case in sync:
        case["case"]["opts"]["model_runner"] = "v1"
    assert count_failing(assert_same_steps_as_vllm, sync) == len(sync)
    monkeypatch.setattr(AcceptanceModel, "proposes", lambda self, index, position: True)
    cases = json.loads(DEVICE_NGRAM_ASYNC_DATA.read_text())["cases"]
    assert count_failing(assert_same_async_spec_steps_as_vllm, cases) == len(cases)


SUFFIX_DATA = Path(__file__).parent / "data" / "spec_suffix_vllm_cases.json"


@pytest.mark.parametrize("index", range(8))
def test_suffix_decoding_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec.py --suffix (K 4 to 10, mean proposals of 1.6 to 7.9
    drafts, match rates 0.5 to 1): each proposal's drafts, as many as simkv draws, go to vLLM
    0.33's scheduler; every step, request and accepted draft equal."""
    case = json.loads(SUFFIX_DATA.read_text())["cases"][index]
    assert case["case"]["opts"]["speculative_method"] == "suffix"
    ours = assert_same_steps_as_vllm(case)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]


def test_recorded_suffix_cases_depend_on_the_proposal_lengths(monkeypatch):
    """Every recorded case needs the drawn lengths: K drafts at every match breaks all eight."""
    monkeypatch.setattr(AcceptanceModel, "num_proposed", k_drafts_at_every_match)
    assert count_failing(assert_same_steps_as_vllm, json.loads(SUFFIX_DATA.read_text())["cases"]) == 8


@pytest.mark.parametrize("mean, k", [(1.0, 24), (2.5, 24), (6.0, 24), (3.0, 4), (4.0, 4)])
def test_suffix_proposal_lengths_have_the_mean_asked(mean, k):
    """Lengths in [1, k] with the asked mean (a geometric distribution cut at k), drawn per
    request and position in a stream of their own; misses propose none; a smaller cap cuts."""
    model = AcceptanceModel((0.5,) * k, 7, mean_draft_tokens=mean)
    lengths = [model.num_proposed(i, p, k) for i in range(200) for p in range(100)]
    assert min(lengths) >= 1 and max(lengths) <= k
    assert abs(sum(lengths) / len(lengths) - mean) < 0.02 * mean
    assert lengths == [model.num_proposed(i, p, k) for i in range(200) for p in range(100)]
    assert all(model.num_proposed(i, 3, 2) == min(2, n) for i, n in zip(range(50), lengths[3::100]))
    plain = AcceptanceModel((0.5,) * k, 7)
    assert [model.num_accepted(i, 5, 3) for i in range(100)] == [plain.num_accepted(i, 5, 3) for i in range(100)]
    missing = AcceptanceModel((0.5,) * k, 7, match_rate=0.4, mean_draft_tokens=mean)
    drawn = [missing.num_proposed(i, p, k) for i in range(200) for p in range(100)]
    assert abs(sum(1 for n in drawn if n) / len(drawn) - 0.4) < 0.01
    assert all(n == m for n, m in zip(drawn, lengths) if n)  # (a match's length is the same draw)


def test_suffix_replay_reports_the_mean_proposal():
    """A replay's drafts per proposal come out at the asked mean (vLLM's num_draft_tokens /
    num_drafts, what a user reads it from), K defaulting to vLLM's 24."""
    import numpy as np
    import pandas as pd

    from simkv.replay.api import replay
    from simkv.traces.schema import trace_from_frame

    rng = np.random.default_rng(0)
    trace = trace_from_frame(pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 20, 200)),
                                           "prompt_tokens": rng.integers(50, 500, 200),
                                           "output_tokens": rng.integers(100, 400, 200)}))
    config = EngineConfig.from_flat({"speculative_method": "suffix", "spec_mean_draft_tokens": 5.0,
                                     "spec_ngram_match_rate": 0.6, "spec_acceptance_rate": 0.8})
    assert config.speculative.num_speculative_tokens == 24
    spec = replay(trace, config).summary["speculative_decoding"]
    assert abs(spec["num_draft_tokens"] / spec["num_drafts"] - 5.0) < 0.15


def test_ngram_match_draws():
    """One draw per request and output position, in a stream of its own: the acceptances do not
    change with the match rate."""
    always, never = AcceptanceModel((0.5,) * 3, 4), AcceptanceModel((0.5,) * 3, 4, match_rate=0.0)
    assert all(always.proposes(i, 9) for i in range(100)) and not any(never.proposes(i, 9) for i in range(100))
    model = AcceptanceModel((0.5,) * 3, 4, match_rate=0.3)
    draws = [model.proposes(i, p) for i in range(200) for p in range(100)]
    assert abs(sum(draws) / len(draws) - 0.3) < 0.01
    assert draws == [model.proposes(i, p) for i in range(200) for p in range(100)]
    assert [model.num_accepted(i, 5, 3) for i in range(100)] == [always.num_accepted(i, 5, 3) for i in range(100)]


def _scheduled_until_done(sched) -> list[tuple[int, int]]:
    scheduled = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        scheduled.append((out.total_num_scheduled_tokens, out.num_draft_tokens))
        sched.update_from_output(out)
    return scheduled


def test_no_ngram_match_decodes_one_token():
    """Match rate 0 on vLLM's V1 model runner (the lookup on the host): the prefill samples, no
    lookup ever matches, so every later step schedules one token (no drafts to verify) and
    nothing is accepted."""
    sched = _spec_scheduler(rate=1.0, spec_ngram_match_rate=0.0, model_runner="v1")
    sched.add_request(make_request(0, 10, 6))
    assert _scheduled_until_done(sched) == [(10, 0)] + [(1, 0)] * 5
    assert sched.spec_stats["num_drafts"] == 0 and sched.spec_stats["num_accepted_tokens"] == 0


def test_no_ngram_match_on_the_device_verifies_rejected_drafts():
    """Match rate 0 on vLLM's V2 model runner (its default: the lookup in a GPU kernel): every
    step after the prefill still verifies K drafts, all rejected, so the request advances one
    token a step at the cost of 1 + K; with matches at the same acceptance it goes faster."""
    for runner in ("auto", "v2"):
        sched = _spec_scheduler(rate=1.0, spec_ngram_match_rate=0.0, model_runner=runner)
        sched.add_request(make_request(0, 10, 6))
        assert _scheduled_until_done(sched) == [(10, 0)] + [(4, 3)] * 5
        stats = sched.spec_stats
        assert stats["num_drafts"] == 5 and stats["num_draft_tokens"] == 15 and stats["num_accepted_tokens"] == 0
    matching = _spec_scheduler(rate=1.0, spec_ngram_match_rate=1.0)
    matching.add_request(make_request(0, 10, 6))
    assert _scheduled_until_done(matching) == [(10, 0), (4, 3), (4, 3)]  # (1 + 3 accepted, then the last 1)


def test_device_ngram_misses_reject_exactly_the_unmatched_positions():
    """With misses drafting (V2), a position's acceptances are the host model's where it matched
    and none where it did not; the proposals are always K."""
    host = AcceptanceModel((0.8,) * 3, 5, match_rate=0.4)
    device = AcceptanceModel((0.8,) * 3, 5, match_rate=0.4, drafts_on_miss=True)
    for i in range(100):
        for p in range(20):
            assert device.num_proposed(i, p, 3) == 3
            expected = host.num_accepted(i, p, 3) if host.proposes(i, p) else 0
            assert device.num_accepted(i, p, 3) == expected


def test_dynamic_speculation_lengths():
    """vLLM's dense lookup: a range's K also covers the gap after it, and the tail; capped at K."""
    spec = SpeculativeConfig("eagle", 4, spec_tokens_per_batch_size="17-64:2,1-8:6,100-256:0")
    assert [spec.drafts_for_batch(n) for n in (1, 8, 9, 16, 17, 64, 99, 100, 300)] == [4, 4, 4, 4, 2, 2, 2, 0, 0]
    sched = _spec_scheduler(rate=1.0, max_num_seqs=4, spec_tokens_per_batch_size="1-1:3,2-4:1")
    sched.add_request(make_request(0, 8, 30))
    out = sched.schedule()
    sched.update_from_output(out)
    assert sched.running[0].spec_drafts == 3  # a step of one request: 3 drafts
    sched.add_request(make_request(1, 4, 30))
    out = sched.schedule()  # the decode (1 + 3) and the new prompt: two requests
    assert [c.num_new_tokens for c in out.chunks] == [4, 4]
    sched.update_from_output(out)
    assert [r.spec_drafts for r in sched.running] == [1, 1]


def test_position_rates_are_unconditional():
    """vLLM logs P(draft i accepted); simkv draws P(draft i | drafts before it)."""
    spec = SpeculativeConfig("eagle", 3, spec_position_acceptance_rates="0.8,0.6,0.3")
    assert spec.conditional_acceptance_rates == pytest.approx((0.8, 0.75, 0.5))


@pytest.mark.parametrize("options, message", [
    (dict(num_speculative_tokens=2), "needs a speculative_method"),
    (dict(speculative_method="medusa", num_speculative_tokens=2), "speculative_method must be one of"),
    (dict(speculative_method="ngram"), "num_speculative_tokens must be >= 1"),
    (dict(speculative_method="draft_model", num_speculative_tokens=2), "needs spec_draft_model"),
    (dict(speculative_method="eagle", num_speculative_tokens=2, spec_position_acceptance_rates="0.5,0.7"),
     "non-increasing"),
    (dict(speculative_method="eagle", num_speculative_tokens=3, spec_position_acceptance_rates="0.5,0.4"),
     "has 2 rates"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, async_scheduling=True, model_runner="v1"),
     "Async scheduling is not supported by the V1 model runner with ngram-based speculative decoding"),
    (dict(speculative_method="suffix", spec_mean_draft_tokens=4.0, async_scheduling=True),
     "V1 model runner with suffix-based speculative decoding"),  # (suffix picks V1)
    (dict(speculative_method="suffix", spec_mean_draft_tokens=4.0, model_runner="v2"),
     "Model Runner V2 does not yet support: speculative method 'suffix'"),
    (dict(speculative_method="eagle", num_speculative_tokens=2, spec_parallel_drafting=True, model_runner="v2"),
     "Model Runner V2 does not yet support: parallel drafting for EAGLE speculative decoding"),
    (dict(speculative_method="eagle", num_speculative_tokens=2, spec_parallel_drafting=True, async_scheduling=True,
          model="llama-3-70b", tensor_parallel_size=4, pipeline_parallel_size=2),
     "V1 model runner with pipeline parallelism"),  # (parallel drafting picks V1, which has no async PP)
    (dict(model_runner="v3"), "model_runner must be one of auto, v1, v2"),
    (dict(speculative_method="mtp", num_speculative_tokens=3, spec_mtp_modules=3, model_runner="v1"),
     "multi-module MTP is vLLM's V2 model runner's"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, preemption_mode="swap"), "preemption_mode 'swap'"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, spec_acceptance_rate=1.5), r"in \[0, 1\]"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, spec_tokens_per_batch_size="2-8:1"), "start at 1"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, spec_tokens_per_batch_size="1-8:1,8-9:2"),
     "must not overlap"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, spec_tokens_per_batch_size="1-8"), "FIRST-LAST:K"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, spec_ngram_match_rate=1.2), r"match_rate must be in"),
    (dict(speculative_method="eagle", num_speculative_tokens=2, spec_ngram_match_rate=0.5), "n-gram and suffix"),
    (dict(speculative_method="suffix"), "needs spec_mean_draft_tokens"),
    (dict(speculative_method="suffix", spec_mean_draft_tokens=30.0), r"in \[1, 24\]"),
    (dict(speculative_method="suffix", num_speculative_tokens=4, spec_mean_draft_tokens=0.5), r"in \[1, 4\]"),
    (dict(speculative_method="suffix", spec_mean_draft_tokens=3.0, spec_tokens_per_batch_size="1-8:2"),
     "not supported with suffix"),
    (dict(speculative_method="suffix", spec_mean_draft_tokens=3.0, async_scheduling=True), "suffix-based speculative"),
    (dict(speculative_method="ngram", num_speculative_tokens=3, spec_mean_draft_tokens=2.0), "suffix decoding's"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, spec_parallel_drafting=True), "not 'ngram'"),
    (dict(speculative_method="mtp", num_speculative_tokens=2, spec_parallel_drafting=True), "not 'mtp'"),
    (dict(spec_parallel_drafting=True), "spec_parallel_drafting needs a speculative_method"),
    (dict(speculative_method="eagle", num_speculative_tokens=3, spec_acceptance_length=4.5), r"in \[1, 4\]"),
    (dict(speculative_method="eagle", num_speculative_tokens=2, spec_acceptance_length=2.0,
          spec_position_acceptance_rates="0.5,0.4"), "not both"),
    (dict(speculative_method="eagle", num_speculative_tokens=2, spec_draft_layers=3), "dflash drafter's"),
    (dict(speculative_method="dflash", num_speculative_tokens=2, spec_draft_layers=0), "must be >= 1"),
    (dict(speculative_method="dflash", num_speculative_tokens=2, spec_parallel_drafting=True), "not 'dflash'"),
    (dict(speculative_method="dflash", num_speculative_tokens=2, model="gemma-3-12b"), "sliding-window"),
    (dict(speculative_method="dflash", num_speculative_tokens=2, model="deepseek-v2-lite"), "latent attention"),
])
def test_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(options)


def test_eagle_block_keys_cover_the_next_token():
    """EAGLE family with prefix caching: a block is shared only if the token after it is
    (vLLM's lookahead block hashes). Two prompts sharing exactly 16 tokens (4 blocks of 4) hit
    4 blocks... capped at 3 under ngram (one token must be computed), and 3 under eagle too,
    but sharing 24 of 32 tokens, ngram hits 6 blocks and eagle 5."""
    hashes = [1, 2, 3]  # 8-token hash blocks: the first 24 prompt tokens are shared
    hits = {}
    for method in ("ngram", "eagle"):
        sched = _spec_scheduler(method=method, rate=0.0)
        sched.add_request(make_request(0, 32, 2, hashes, 8))
        while sched.has_unfinished_requests():
            sched.update_from_output(sched.schedule())
        sched.add_request(make_request(1, 32, 2, hashes, 8))
        out = sched.schedule()
        hits[method] = out.prefix_hit_tokens
    assert hits == {"ngram": 24, "eagle": 20}


def _random_case(rng) -> dict:
    block_size = int(rng.choice([4, 8, 16]))
    max_model_len = int(rng.choice([64, 128]))
    method = str(rng.choice(["ngram", "eagle", "draft_model"]))
    k = int(rng.choice([1, 3, 5]))
    opts = dict(block_size=block_size, max_model_len=max_model_len, max_num_seqs=int(rng.choice([2, 8])),
                max_num_batched_tokens=int(rng.choice([16, 64, 256])), num_gpu_blocks=max_model_len // block_size + 4,
                enable_prefix_caching=bool(rng.random() < 0.7), speculative_method=method, num_speculative_tokens=k,
                spec_acceptance_rate=float(rng.random()), spec_seed=int(rng.integers(0, 99)),
                scheduling_policy=str(rng.choice(["fcfs", "priority"])))
    if method == "draft_model":
        opts["spec_draft_model"] = "tiny-llama"
    prefix = [int(x) for x in rng.integers(0, 3, 20)]
    requests = []
    for i in range(int(rng.integers(2, 25))):
        prompt = int(rng.integers(1, max_model_len))
        requests.append({"row": i, "arrival_step": int(rng.integers(0, 20)), "prompt": prompt,
                         "output": int(rng.integers(1, 40)), "priority": int(rng.integers(0, 3)),
                         "block_hashes": prefix[:-(-prompt // 8)]})
    return {"opts": opts, "requests": requests}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_cases_keep_the_books(async_scheduling):
    """Random small engines (pools that preempt, shared prompts, any acceptance), synchronous and
    async (eagle and draft models there): every request finishes with all its output tokens,
    accepted drafts never exceed verified ones, and every block is free at the end."""
    import numpy as np

    rng = np.random.default_rng(11)
    preemptions = 0
    for _ in range(40):
        case = _random_case(rng)
        if async_scheduling:
            if case["opts"]["speculative_method"] == "ngram":
                case["opts"]["speculative_method"] = "eagle"
            case["opts"]["async_scheduling"] = True
        result = (drive_steps_async if async_scheduling else drive_steps)(case)
        assert "error" not in result
        sched = result["scheduler"]
        limit = case["opts"]["max_model_len"]
        for r in case["requests"]:
            first, finish = result["requests"][str(r["row"])]
            assert 0 <= first <= finish
            request = result["objects"][r["row"]]
            assert request.num_output_tokens == min(r["output"], limit - r["prompt"])
            assert request.num_accepted_tokens <= request.num_draft_tokens
            assert request.num_in_flight_tokens == 0  # (async: every scheduled step's output was processed)
        assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0
        stats = sched.spec_stats
        assert 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
        assert sum(stats["accepted_per_position"]) == stats["num_accepted_tokens"]
        assert all(a >= b for a, b in zip(stats["accepted_per_position"], stats["accepted_per_position"][1:]))
        assert not sched.running and not sched.has_unfinished_requests()
        preemptions += sched.num_preemptions
    assert preemptions > 0  # the cases do exercise preemption


@pytest.mark.parametrize("async_scheduling, pipeline", [(False, 0), (True, 0), (False, 2), (True, 3)])
def test_decode_chunks_steps_are_the_general_paths(monkeypatch, async_scheduling, pipeline):
    """Scheduler._decode_chunks_step (every running request verifying its drafts, nothing waiting) gives
    the steps the general path gives: on 40 random engines (pools that preempt, shared prompts,
    budgets and thresholds that cut drafts, ngram misses, a draft model, parallel drafting,
    dflash), synchronous and async (two batches deep), every step's chunks, counts and blocks,
    the cache, and every request's tokens, equal with it and without it; it served a good share
    of the steps."""
    import numpy as np

    from simkv.core.scheduler import Scheduler as S

    rng = np.random.default_rng(5)
    taken = [0, 0]
    original = S._decode_chunks_step

    def counted(self):
        out = original(self)
        taken[out is None] += 1
        return out

    def trace(case, fast):
        steps = []
        schedule, update = S.schedule, S.update_from_output

        def record_schedule(self):
            if not fast:
                self._decode_chunks_fast = False
            out = schedule(self)
            steps.append((out.step, [(c.request.index, c.num_computed_tokens, c.num_new_tokens, c.num_spec_tokens,
                                      c.is_resumed) for c in out.chunks], out.num_running, out.num_waiting,
                          out.num_blocks_used, out.num_verify_tokens, out.num_draft_tokens,
                          out.num_spec_tokens_to_schedule, out.decode_context_tokens, len(out.preempted),
                          [(r.num_cached_blocks, r.spec_drafts, r.spec_prefill_chunk) for r in self.running]))
            return out

        def record_update(self, out):
            finished = update(self, out)
            steps.append(([r.index for r in finished], out.num_blocks_used_end, out.num_accepted_tokens,
                          out.num_spec_emissions, len(self.kv_cache_manager.block_pool.cached_block_hash_to_block),
                          [(self.kv_cache_manager.num_cached_block.get(r.index), r.num_cached_blocks, r.last_sched_step,
                            r.num_in_flight_tokens, r.num_output_placeholders) for r in self.running],
                          self._scheduled_through))
            return finished

        with monkeypatch.context() as m:
            m.setattr(S, "schedule", record_schedule)
            m.setattr(S, "update_from_output", record_update)
            result = (drive_steps_pipeline if pipeline else drive_steps_async if async_scheduling else drive_steps)(case)
        objects = {row: (q.num_output_tokens, q.num_computed_tokens, q.num_draft_tokens, q.num_accepted_tokens,
                         q.first_token_step, q.finish_step, q.num_cached_blocks, q.num_output_placeholders,
                         q.num_in_flight_tokens) for row, q in result["objects"].items()}
        return steps, result["requests"], objects

    monkeypatch.setattr(S, "_decode_chunks_step", counted)
    for i in range(40):
        case = _random_case(rng)
        opts = case["opts"]
        if i % 4 == 1:
            opts["long_prefill_token_threshold"] = int(rng.integers(1, 6))
        if i % 4 == 2 and opts["speculative_method"] == "ngram":
            opts["spec_ngram_match_rate"] = 0.5
            if i % 8 == 2 and not async_scheduling:  # (on the host: no drafts without a match)
                opts["model_runner"] = "v1"
        if i % 4 == 3 and opts["speculative_method"] != "ngram" and not (async_scheduling and pipeline):
            opts["spec_parallel_drafting"] = True  # (vLLM's V1 runner, which has no async pipeline stages)
        if i % 8 == 4 and opts["speculative_method"] != "ngram":
            opts["speculative_method"] = "dflash"
            opts.pop("spec_draft_model", None)
        if i % 2:  # (content that goes on over the reply: its blocks are cached as they fill)
            for r in case["requests"]:
                r["block_hashes"] = [int(x) for x in rng.integers(0, 3, -(-(r["prompt"] + r["output"]) // 8))]
        if async_scheduling:
            opts["async_scheduling"] = True  # (ngram too: vLLM's V2 runner drafts n-grams on the device)
        if pipeline:
            opts["pipeline_parallel_size"] = pipeline
            if not async_scheduling:  # (pipeline stages run drafts under async scheduling only)
                for key in [k for k in opts if k.startswith("spec")] + ["num_speculative_tokens"]:
                    opts.pop(key)
                opts["speculative_method"] = None
        assert trace(case, True) == trace(case, False)
    assert taken[0] > 300 and taken[1] > 300, taken  # (the fast path, and the general one, each served many steps)
