"""`vllm bench serve --dataset-name random`'s traffic (simkv/traces/vllm_random.py) against the
draws of vLLM 0.33's own functions (recorded by scripts/record_vllm_random.py)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from simkv.traces.errors import TraceError
from simkv.traces.vllm_random import RandomDataset

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_random_recorded.json").read_text())

LENGTHS = {"a": dict(num_prompts=8, seed=0, random_input_len=1024, random_output_len=128, num_special_tokens=1),
           "b": dict(num_prompts=8, seed=7, input_range_ratio=0.5, output_range_ratio=0.5, random_input_len=300,
                     random_output_len=50, num_special_tokens=1),
           "c": dict(num_prompts=8, seed=3, input_range_ratio=0.2, output_range_ratio=0.9, random_input_len=2000,
                     random_output_len=400, num_special_tokens=0)}
SENDS = {"poisson": dict(num_prompts=8, seed=0, request_rate=4.0),
         "gamma": dict(num_prompts=8, seed=5, request_rate=10.0, burstiness=0.5),
         "uniform": dict(num_prompts=5, seed=0, request_rate=2.0, burstiness=math.inf),
         "linear": dict(num_prompts=6, seed=1, ramp_up_strategy="linear", ramp_up_start_rps=1, ramp_up_end_rps=9),
         "exp": dict(num_prompts=6, seed=2, burstiness=2.0, ramp_up_strategy="exponential", ramp_up_start_rps=2,
                     ramp_up_end_rps=8)}


@pytest.mark.parametrize("case", sorted(LENGTHS))
def test_lengths_are_vllms_draws(case):
    sampled, output = RandomDataset(**LENGTHS[case]).lengths()
    assert sampled.tolist() == RECORDED[case]["input"] and output.tolist() == RECORDED[case]["output"]


@pytest.mark.parametrize("case", sorted(SENDS))
def test_send_times_are_vllms(case):
    assert np.allclose(RandomDataset(**SENDS[case]).send_times(), RECORDED["t_" + case], rtol=1e-12, atol=0)


def test_the_trace_shares_the_prefix_and_nothing_else():
    """The server sees BOS + prefix + sampled tokens; the first 1 + 40 = 41 tokens are two full
    shared 16-token blocks, the rest each prompt's own."""
    trace = RandomDataset(num_prompts=5, random_input_len=100, random_output_len=20, input_range_ratio=0.5,
                          random_prefix_len=40, request_rate=2.0).trace()
    sampled, _ = RandomDataset(num_prompts=5, random_input_len=100, random_output_len=20, input_range_ratio=0.5,
                               random_prefix_len=40, request_rate=2.0).lengths()
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
    ({"burstiness": 0.0}, "--burstiness"), ({"ramp_up_strategy": "linear"}, "--ramp-up-start-rps"),
    ({"random_input_len": 1, "num_special_tokens": 1}, "too small"), ({"request_rate": 0.0}, "--request-rate"),
])
def test_bad_schedules_are_named(options, match):
    with pytest.raises(TraceError, match=match):
        RandomDataset(**options).trace()
