"""Replies a trace describes: a next turn's prompt hits the previous turn's reply blocks.

A hash list longer than its prompt needs goes on over the reply (docs/traces.md). vLLM hashes a
request's output tokens as they come and caches their full blocks, so a chat's next turn, whose
prompt repeats the reply, hits them. The recorded cases come from the real vLLM 0.33 scheduler
(`scripts/oracle_fuzz.py --replies --record`), whose fake model samples the reply's content tokens.
"""

import json
from pathlib import Path

import pandas as pd
import pytest

from simkv.config import EngineConfig
from simkv.replay.api import replay
from simkv.traces.schema import trace_from_frame
from tests.core.helpers import assert_as_recorded, observed_as_recorded, replay_recorded

RECORDED = json.loads((Path(__file__).parent / "data" / "reply_vllm_cases.json").read_text())


def _replay_case(case: dict, trace: dict | None = None):
    return replay_recorded(case, trace)


@pytest.mark.parametrize("index", range(len(RECORDED["cases"])))
def test_recorded_vllm_cases(index: int) -> None:
    case = RECORDED["cases"][index]
    assert_as_recorded(observed_as_recorded(_replay_case(case)), case["vllm"])


def test_recorded_cases_depend_on_the_replies() -> None:
    """Cut every hash list back to its prompt: the replies are unique again and the hits fall
    short of vLLM's (the recorded cases test the reply content, not only the prompts)."""
    short = 0
    for case in RECORDED["cases"]:
        trace = dict(case["trace"])
        h = trace["hash_block_tokens"]
        trace["block_hashes"] = [ids[:-(-p // hb)] for ids, p, hb in zip(trace["block_hashes"], trace["prompt_tokens"], h)]
        short += _replay_case(case, trace).summary["prefix_cache_hits_tokens"] < case["vllm"]["prefix_hits"]
    assert short >= len(RECORDED["cases"]) // 2


def _two_turns(second_arrival: float, reply_ids: bool = True, n: int = 1, first_prompt: int = 64) -> list[int]:
    """Turn 1: `first_prompt` tokens, a 40-token reply; turn 2 repeats both and adds 20 tokens.
    16-token hash and KV blocks."""
    stream = list(range(100, 120))
    p1, o1 = first_prompt, 40
    p2 = p1 + o1 + 20
    first = stream[:-(-(p1 + o1) // 16)] if reply_ids else stream[:-(-p1 // 16)]
    frame = pd.DataFrame({"arrival_time_s": [0.0, second_arrival], "prompt_tokens": [p1, p2],
                          "output_tokens": [o1, 5], "block_hashes": [first, stream[:-(-p2 // 16)]],
                          "hash_block_tokens": [16, 16], "n": [n, 1]})
    config = EngineConfig.from_flat(dict(block_size=16, num_gpu_blocks=200, max_model_len=1024))
    res = replay(trace_from_frame(frame), config, "unit")
    finished_first = res.requests["finish_time_s"][0] < second_arrival
    assert finished_first == (second_arrival > 50)  # (unit steps: turn 1 takes 41 s)
    return res.requests["prefix_hit_tokens"].tolist()


def test_next_turn_hits_the_reply_blocks() -> None:
    # Turn 1 computes 64 + 39 tokens (its last sampled token has no KV): 6 full blocks, 96 tokens.
    assert _two_turns(100.0) == [0, 96]
    # Replies as unique content (hash lists of the prompts only): the prompt's 4 blocks.
    assert _two_turns(100.0, reply_ids=False) == [0, 64]


def test_reply_blocks_are_findable_once_released() -> None:
    # Turn 2 arrives while turn 1 still decodes (a trace whose prompt repeats a reply not yet
    # written): simkv makes reply blocks findable when their request releases them.
    assert _two_turns(5.0) == [0, 64]


def test_a_list_the_prompt_needs_does_not_describe_the_reply() -> None:
    # 60 prompt tokens take 4 ids of 16 (64 positions): a list of 4 describes no reply, so
    # positions 60-63 are unique and turn 2 hits the 3 full prompt blocks only.
    assert _two_turns(100.0, reply_ids=False, first_prompt=60) == [0, 48]
    # 5 ids (60 + 40 tokens reach 7): the reply is described from its first token.
    assert _two_turns(100.0, first_prompt=60) == [0, 96]


def test_parallel_sampling_replies_are_not_the_traces() -> None:
    # (turn 1's second member hits its first's 3 prompt blocks before the last prompt token: the
    # row reports both members' hits; turn 2 hits the prompt, no member's reply)
    assert _two_turns(100.0, n=2) == [48, 64]
