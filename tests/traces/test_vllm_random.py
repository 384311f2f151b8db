"""`vllm bench serve --dataset-name random`'s traffic (simkv/traces/vllm_random.py) against the
draws of vLLM 0.33's own functions (recorded by scripts/record_vllm_random.py)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from simkv.traces.errors import TraceError
from simkv.traces.vllm_random import PrefixRepetitionDataset, RandomDataset, Schedule

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_random_recorded.json").read_text())

LENGTHS = {"a": dict(num_prompts=8, seed=0, random_input_len=1024, random_output_len=128, num_special_tokens=1),
           "b": dict(num_prompts=8, seed=7, input_range_ratio=0.5, output_range_ratio=0.5, random_input_len=300,
                     random_output_len=50, num_special_tokens=1),
           "c": dict(num_prompts=8, seed=3, input_range_ratio=0.2, output_range_ratio=0.9, random_input_len=2000,
                     random_output_len=400, num_special_tokens=0)}
SENDS = {"poisson": (8, 0, dict(request_rate=4.0)), "gamma": (8, 5, dict(request_rate=10.0, burstiness=0.5)),
         "uniform": (5, 0, dict(request_rate=2.0, burstiness=math.inf)),
         "linear": (6, 1, dict(ramp_up_strategy="linear", ramp_up_start_rps=1, ramp_up_end_rps=9)),
         "exp": (6, 2, dict(burstiness=2.0, ramp_up_strategy="exponential", ramp_up_start_rps=2, ramp_up_end_rps=8))}


@pytest.mark.parametrize("case", sorted(LENGTHS))
def test_lengths_are_vllms_draws(case):
    sampled, output = RandomDataset(**LENGTHS[case]).lengths()
    assert sampled.tolist() == RECORDED[case]["input"] and output.tolist() == RECORDED[case]["output"]


@pytest.mark.parametrize("case", sorted(SENDS))
def test_send_times_are_vllms(case):
    n, seed, schedule = SENDS[case]
    assert np.allclose(Schedule(**schedule).send_times(n, seed), RECORDED["t_" + case], rtol=1e-12, atol=0)


def test_the_trace_shares_the_prefix_and_nothing_else():
    """The server sees BOS + prefix + sampled tokens; the first 1 + 40 = 41 tokens are two full
    shared 16-token blocks, the rest each prompt's own."""
    dataset = RandomDataset(num_prompts=5, random_input_len=100, random_output_len=20, input_range_ratio=0.5,
                            random_prefix_len=40, schedule=Schedule(request_rate=2.0))
    trace, (sampled, _) = dataset.trace(), dataset.lengths()
    assert trace.prompt_tokens.tolist() == (41 + sampled).tolist()
    rows = [list(map(int, trace.block_hashes(i))) for i in range(5)]
    assert all(r[:2] == [0, 1] for r in rows)
    own = [set(r[2:]) for r in rows]
    assert all(not (own[i] & own[j]) for i in range(5) for j in range(i + 1, 5))
    assert [len(r) for r in rows] == [-(-p // 16) for p in trace.prompt_tokens.tolist()]
    assert list(trace.request_id) == [f"bench-{i}" for i in range(5)]
    assert trace.arrival_time_s[-1] == pytest.approx(5 / 2.0)


def test_all_at_once_at_an_infinite_rate():
    assert (RandomDataset(num_prompts=4).trace().arrival_time_s == 0).all()


@pytest.mark.parametrize("options, match", [
    ({"num_prompts": 0}, "--num-prompts"), ({"input_range_ratio": 1.0}, "range-ratio"),
    ({"schedule": Schedule(burstiness=0.0)}, "--burstiness"),
    ({"schedule": Schedule(ramp_up_strategy="linear")}, "--ramp-up-start-rps"),
    ({"random_input_len": 1, "num_special_tokens": 1}, "too small"),
    ({"schedule": Schedule(request_rate=0.0)}, "--request-rate"),
])
def test_bad_schedules_are_named(options, match):
    with pytest.raises(TraceError, match=match):
        RandomDataset(**options).trace()


def test_prefix_repetition_groups_share_their_prefix_in_the_clients_shuffled_order():
    """3 prefixes of 64 tokens, 10 // 3 = 3 prompts each (9 sent): BOS + 64 tokens is 4 full
    shared blocks per group, the suffixes own. The order is Python's random.Random(seed)
    shuffling the rows grouped by prefix, as the client does."""
    dataset = PrefixRepetitionDataset(num_prompts=10, prefix_len=64, suffix_len=40, num_prefixes=3, output_len=9,
                                      seed=4)
    trace = dataset.trace()
    assert len(trace) == 9 and (trace.prompt_tokens == 1 + 64 + 40).all() and (trace.output_tokens == 9).all()
    rows = [list(map(int, trace.block_hashes(i))) for i in range(9)]
    expected = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    import random
    random.Random(4).shuffle(expected)
    assert dataset.groups().tolist() == expected
    for i, g in enumerate(expected):
        assert rows[i][:4] == list(range(4 * g, 4 * g + 4))
    own = [set(r[4:]) for r in rows]
    assert all(not (own[i] & own[j]) for i in range(9) for j in range(i + 1, 9))
    assert PrefixRepetitionDataset(num_prompts=6, num_prefixes=2, disable_shuffle=True).groups().tolist() == [
        0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("seed, n, k", [(4, 10, 3), (0, 20, 4)])
def test_prefix_repetition_order_is_vllms(seed, n, k):
    groups = PrefixRepetitionDataset(num_prompts=n, num_prefixes=k, seed=seed).groups()
    assert groups.tolist() == RECORDED[f"prefix_repetition_{seed}_{n}_{k}"]
