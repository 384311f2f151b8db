"""The worked numbers of real vLLM 0.33 (shared/VLLM_SEMANTICS.md), reproduced exactly."""

import numpy as np
import pytest

from simkv.core.scheduler import Scheduler
from simkv.traces.synth import lognormal
from tests.core.helpers import drive, make_config, make_request


def req400(prefix_groups: int = 0, prefix_tokens: int = 1000):
    trace = lognormal()
    reqs = []
    for i in range(len(trace)):
        p, o = int(trace.prompt_tokens[i]), int(trace.output_tokens[i])
        if prefix_groups:
            g = i % prefix_groups
            hashes = np.arange(prefix_tokens // 8, dtype=np.int64) + 1_000_000 * (g + 1)
            reqs.append(make_request(i, prefix_tokens + p, o, hashes, 8))
        else:
            reqs.append(make_request(i, p, o))
    return reqs


def run(reqs, use_runs=True, **kw):
    sched = Scheduler(make_config(**kw), 6250)
    for r in reqs:
        sched.add_request(r)
    return drive(sched, use_runs)


@pytest.mark.parametrize("use_runs", [False, True])
def test_req400(use_runs):
    out = run(req400(), use_runs)
    assert (out["steps"], out["peak_running"], out["preemptions"], out["preempted_requests"]) == (1117, 183, 27, 23)
    assert (out["hits"], out["queries"]) == (5696, 218108)
    assert (out["prefill_tokens"], out["decode_tokens"]) == (212412, 71525)


def test_req400_watermark():
    out = run(req400(), watermark=0.01)
    assert (out["steps"], out["preemptions"], out["preempted_requests"]) == (1120, 0, 0)


@pytest.mark.parametrize("use_runs", [False, True])
def test_req400_prefix_groups(use_runs):
    out = run(req400(prefix_groups=10), use_runs)
    assert (out["steps"], out["peak_running"], out["preemptions"], out["preempted_requests"]) == (1174, 159, 44, 36)
    assert (out["hits"], out["queries"]) == (438464, 667583)
    assert (out["prefill_tokens"], out["decode_tokens"]) == (229119, 71508)


def test_req400_prefix_groups_caching_off():
    out = run(req400(prefix_groups=10), enable_prefix_caching=False)
    assert (out["steps"], out["peak_running"], out["preemptions"], out["preempted_requests"]) == (1777, 63, 18, 18)
    assert out["hits"] == 0


def test_each_non_first_group_member_hits_992_tokens():
    reqs = req400(prefix_groups=10)
    sched = Scheduler(make_config(), 6250)
    for r in reqs:
        sched.add_request(r)
    drive(sched)
    first_hits = [r.num_prefix_hit_tokens for r in reqs]
    assert first_hits[:10] == [0] * 10
    assert all(h == 992 for h in first_hits[10:])
