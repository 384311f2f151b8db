"""vLLM's multi-turn benchmark's conversations (simkv/traces/vllm_multi_turn.py)."""

import json

import numpy as np
import pytest

from simkv.traces.errors import TraceError
from simkv.traces.vllm_multi_turn import (BOS_TOKENS, EOT_TOKENS, HEADER_TOKENS, INSTRUCTION_TOKENS, INTRO_TOKENS,
                                          PREFIX_LEAD_TOKENS, draw_conversations, multi_turn_trace, read_config)
from tests.cli_runs import cli_fails, cli_ok

# vLLM's example generate_multi_turn.json (benchmarks/multi_turn)
EXAMPLE = {"filetype": "generate_conversations", "num_conversations": 24, "text_files": ["pg1184.txt"],
           "print_stats": False,
           "prompt_input": {"num_turns": {"distribution": "uniform", "min": 12, "max": 18},
                            "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
                            "prefix_num_tokens": {"distribution": "lognormal", "average": 1000, "max": 5000},
                            "num_tokens": {"distribution": "uniform", "min": 120, "max": 160}},
           "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 80, "max": 120}}}


def _config(tmp_path, conf=EXAMPLE):
    path = tmp_path / "generate_multi_turn.json"
    path.write_text(json.dumps(conf))
    return read_config(path)


def test_the_draws_follow_the_generators_order_and_rules(tmp_path):
    """Message counts first (even, >= 2), then the conversations' prefixes (lognormal scaled to
    their average), the common prefix, then per conversation its user and answer counts."""
    drawn = draw_conversations(_config(tmp_path), seed=0)
    rng = np.random.RandomState(0)
    messages = rng.randint(12, 19, size=24)
    assert np.array_equal(drawn.num_messages, messages + messages % 2)
    prefix = rng.lognormal(np.log(850.0), np.sqrt(2 * np.log(1 / 0.85)), size=24)
    prefix = np.round(np.minimum(prefix * 1000 / prefix.mean(), 5000)).astype(int)
    assert np.array_equal(drawn.prefix_tokens, prefix)
    assert drawn.common_prefix_tokens == 500  # (a constant draws nothing)
    first_inputs = rng.randint(120, 161, size=int(drawn.num_messages[0]))
    assert np.array_equal(drawn.input_tokens[0], first_inputs)
    assert np.array_equal(drawn.output_tokens[0], rng.randint(80, 121, size=int(drawn.num_messages[0])))
    assert draw_conversations(_config(tmp_path), seed=1).prefix_tokens.tolist() != prefix.tolist()


def test_each_turn_repeats_the_conversation_so_far(tmp_path):
    config = _config(tmp_path)
    trace = multi_turn_trace(config, seed=0)
    drawn = draw_conversations(config, seed=0)
    assert len(trace) == int(drawn.num_messages.sum()) // 2
    rows = {rid: i for i, rid in enumerate(trace.request_id.tolist())}
    for c in range(24):
        first = rows[f"CONV_ID_{c}/turn0"]
        common, own = 500 - 1, int(drawn.prefix_tokens[c])
        user0 = max(int(drawn.input_tokens[c][0]), INTRO_TOKENS + INSTRUCTION_TOKENS + common) + PREFIX_LEAD_TOKENS + own
        assert trace.prompt_tokens[first] == BOS_TOKENS + 2 * HEADER_TOKENS + EOT_TOKENS + user0
        for k in range(1, int(drawn.num_messages[c]) // 2):
            row, before = rows[f"CONV_ID_{c}/turn{k}"], rows[f"CONV_ID_{c}/turn{k - 1}"]
            user = max(int(drawn.input_tokens[c][2 * k]), INTRO_TOKENS + INSTRUCTION_TOKENS)
            assert trace.output_tokens[before] == drawn.output_tokens[c][2 * k - 1]
            assert trace.prompt_tokens[row] == (trace.prompt_tokens[before] + trace.output_tokens[before] + EOT_TOKENS
                                                + 2 * HEADER_TOKENS + EOT_TOKENS + user)
            # its hash list goes on from the previous turn's (prompt and reply)
            previous = trace.block_hashes(before)
            assert trace.block_hashes(row)[:len(previous) - 1].tolist() == previous[:-1].tolist()
    # every conversation opens with the same template header and common prefix: (1 + 4 + 499) // 16 blocks
    openings = {tuple(trace.block_hashes(rows[f"CONV_ID_{c}/turn0"])[:32].tolist()) for c in range(24)}
    assert len({o[:31] for o in openings}) == 1 and len({o[31] for o in openings}) == 24
    assert set(trace.arrival_time_s.tolist()) == {0.0} and not trace.think_time_s.any()


def test_max_turns_keeps_the_first_messages(tmp_path):
    trace = multi_turn_trace(_config(tmp_path), seed=0, max_turns=4)
    assert len(trace) == 48 and {rid.rsplit("/", 1)[1] for rid in trace.request_id.tolist()} == {"turn0", "turn1"}


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("num_conversations"), "'num_conversations' must be a whole number"),
    (lambda c: c["prompt_input"].pop("num_tokens"), "missing field 'prompt_input.num_tokens'"),
    (lambda c: c["prompt_output"]["num_tokens"].update(distribution="beta"), "unknown distribution 'beta'"),
    (lambda c: c["prompt_input"]["num_turns"].update(min=1.5), "min and max must be whole numbers"),
    (lambda c: c["prompt_input"]["prefix_num_tokens"].pop("average"), "needs 'mean'"),
    (lambda c: c.update(filetype="conversations"), "not a conversation generator's file"),
])
def test_bad_files_are_refused_naming_the_field(tmp_path, edit, message):
    conf = json.loads(json.dumps(EXAMPLE))
    edit(conf)
    with pytest.raises(TraceError, match=message) as err:
        _config(tmp_path, conf)
    assert "generate_multi_turn.json" in str(err.value)


def test_from_the_cli_and_replayed_as_its_clients(tmp_path):
    path = tmp_path / "gen.json"
    path.write_text(json.dumps(EXAMPLE))
    out = cli_ok(["trace", "from-vllm-multi-turn", str(path), "--out", str(tmp_path / "t.parquet")])
    assert "wrote 185 turns of 24 conversations" in out
    replayed = cli_ok(["replay", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "r"), "--client-max-concurrency",
                       "2", "--client-max-active-sessions", "6"])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["peak_running"] <= 2 and summary["num_finished"] == 185 and "active sessions limit" in replayed
    assert summary["prefix_cache_hit_rate"] > 0.8  # (each turn repeats its conversation)
    assert "--max-turns" in cli_fails(["trace", "from-vllm-multi-turn", str(path), "--out", str(tmp_path / "u.parquet"),
                                       "--max-turns", "1"])
