"""Clients that rotate over their own conversations (`client_rotation`, vLLM's multi-turn
benchmark's clients): simkv/replay/client_rotation.py."""

import json
import random
from collections import Counter, deque

import numpy as np
import pandas as pd
import pytest

from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.traces.synth_sessions import SessionShape, multi_turn
from simkv.traces.vllm_multi_turn import multi_turn_trace, read_config
from tests.replay.engine_setups import KINDS, engine_setup
from tests.traces.test_vllm_multi_turn import EXAMPLE


@pytest.fixture(scope="module")
def benchmark_trace(tmp_path_factory):
    """The conversations of vLLM's example generator file: 24, all ready at 0."""
    path = tmp_path_factory.mktemp("gen") / "generate_multi_turn.json"
    path.write_text(json.dumps(EXAMPLE))
    return multi_turn_trace(read_config(path))


def _script_order(turns: list[int], per_client: int, chooser: random.Random | None = None,
                  max_requests: int | None = None, first_turn: int = 0) -> list[tuple[int, int]]:
    """One client of the benchmark script, written from its loop: (conversation, turn) in the
    order it sends them. It leaves after `max_requests`; it fills up to `per_client` conversations
    from the queue (leaving when the queue is empty), sends the next turn of the newest (or, with
    a `chooser`, of one drawn from those it has, in the order it took them), and puts a
    conversation that goes on at the back. `first_turn`: 1 after a warm-up (conversations of one
    turn are passed over)."""
    queue = deque(c for c in range(len(turns)) if turns[c] > first_turn)
    active, taken, sent, order = deque(), [], Counter({c: first_turn for c in range(len(turns))}), []
    while max_requests is None or len(order) < max_requests:
        while len(active) < per_client and queue:
            active.append(queue.popleft())
            taken.append(active[-1])
        if len(active) < per_client:
            break  # (the queue ran dry: the client leaves)
        if chooser is None:
            conversation = active.pop()
        else:
            conversation = chooser.choice(taken)
            active.remove(conversation)
        order.append((conversation, sent[conversation]))
        sent[conversation] += 1
        if sent[conversation] < turns[conversation]:
            active.appendleft(conversation)
        else:
            taken.remove(conversation)
    return order


def _sent_order(requests: pd.DataFrame) -> list[tuple[int, int]]:
    sent = requests[requests["status"] != "not_sent"].sort_values("arrival_time_s")
    parts = sent["request_id"].str.extract(r"CONV_ID_(\d+)/turn(\d+)").astype(int)
    return list(zip(parts[0], parts[1]))


def _turns(trace) -> list[int]:
    return pd.Series(trace.session_id).value_counts().reindex([f"CONV_ID_{c}" for c in range(24)]).tolist()


def _one_client(trace, per_client: int, **options) -> pd.DataFrame:
    config = EngineConfig.from_flat({"client_max_concurrency": 1, "client_max_active_sessions": per_client,
                                     "client_rotation": True, "model": "llama-3.1-8b"} | options)
    return replay(trace, config).requests


@pytest.mark.parametrize("per_client", [2, 5])
def test_one_client_draws_its_conversations_as_the_script(benchmark_trace, per_client):
    """--conversation-sampling random: Python's random.choice over the conversations the client
    has, seeded --seed + client + 1."""
    requests = _one_client(benchmark_trace, per_client, client_conversation_sampling="random", client_seed=5)
    expected = _script_order(_turns(benchmark_trace), per_client, chooser=random.Random(5 + 0 + 1))
    assert _sent_order(requests) == expected
    assert expected != _script_order(_turns(benchmark_trace), per_client)


def test_a_client_leaves_after_its_share_of_the_requests(benchmark_trace):
    requests = _one_client(benchmark_trace, 3, client_max_requests=40, client_early_stop=True)
    assert _sent_order(requests) == _script_order(_turns(benchmark_trace), 3, max_requests=40)
    assert (requests["status"] == "not_sent").sum() == len(requests) - 40


def test_a_warmup_sends_every_first_turn_alone_then_the_rest(benchmark_trace):
    """--warmup-step: every conversation's first turn, one client after another taking them from
    the queue; once all are answered the clients start over from the second turns (whose prompts
    then find the first turns' blocks)."""
    requests = _one_client(benchmark_trace, 3, client_warmup=True)
    order = _sent_order(requests)
    assert order[:24] == [(c, 0) for c in range(24)]
    assert order[24:] == _script_order(_turns(benchmark_trace), 3, first_turn=1)
    two = replay(benchmark_trace, EngineConfig.from_flat({
        "client_max_concurrency": 2, "client_max_active_sessions": 6, "client_rotation": True,
        "client_warmup": True, "client_early_stop": True, "model": "llama-3.1-8b"}))
    end = two.summary["session_pacing"]["warmup_end_s"]
    first = two.requests["request_id"].str.endswith("/turn0")
    assert (two.requests.loc[first, "finish_time_s"] < end).all()
    assert (two.requests.loc[~first & (two.requests["status"] == "finished"), "arrival_time_s"] >= end).all()


@pytest.mark.parametrize("per_client", [1, 3])
def test_one_client_sends_in_the_scripts_order(benchmark_trace, per_client):
    requests = _one_client(benchmark_trace, per_client)
    turns = _turns(benchmark_trace)
    expected = _script_order(turns, per_client)
    assert _sent_order(requests) == expected
    sent = requests[requests["status"] != "not_sent"].sort_values("arrival_time_s")
    assert (sent["status"] == "finished").all() and len(requests) - len(sent) == sum(turns) - len(expected)
    if per_client == 1:
        assert len(expected) == sum(turns)  # (one conversation at a time: every turn)
    times = sent[["arrival_time_s", "finish_time_s"]].to_numpy()
    assert (times[1:, 0] > times[:-1, 1]).all()  # (one request at a time)


@pytest.mark.parametrize("options", [{}, {"client_early_stop": True}, {"client_request_rate": 0.8}])
def test_one_conversation_per_client_is_the_shared_pool(options):
    """With M = N each client has one conversation: the rotation is SessionPacing's shared pool
    of due turns, byte for byte."""
    trace = multi_turn(SessionShape(sessions=30, turns=4, think_time_s=0.0), seed=9)
    base = {"client_max_concurrency": 5, "client_max_active_sessions": 5} | options
    pool = replay(trace, EngineConfig.from_flat(base)).requests
    rotation = replay(trace, EngineConfig.from_flat(base | {"client_rotation": True})).requests
    pd.testing.assert_frame_equal(pool, rotation)


def test_a_rejected_turn_ends_its_conversation_and_the_client_goes_on(benchmark_trace):
    """The script drops a conversation whose request failed (here: a prompt past max_model_len)
    and takes the next: the conversation's later turns are never sent."""
    config = EngineConfig.from_flat({"client_max_concurrency": 2, "client_max_active_sessions": 4,
                                     "client_rotation": True, "model": "llama-3.1-8b", "max_model_len": 3000})
    requests = replay(benchmark_trace, config).requests
    conversation = requests["request_id"].str.rsplit("/turn", n=1).str[0]
    turn = requests["request_id"].str.rsplit("/turn", n=1).str[1].astype(int)
    rejected = requests[requests["status"] == "rejected"]
    assert len(rejected) > 0
    for rid in rejected["request_id"]:
        c, t = rid.rsplit("/turn", 1)
        later = requests[(conversation == c) & (turn > int(t))]
        assert (later["status"] == "not_sent").all()
    assert (requests["status"] == "finished").sum() > len(requests) // 2


@pytest.mark.parametrize("kind", KINDS)
def test_rotating_clients_replay_the_same_by_decode_runs_and_steps(kind):
    trace = multi_turn(SessionShape(sessions=24, turns=4, think_time_s=0.0), seed=2)
    options, extra = engine_setup(kind, dict(num_gpu_blocks=2000, max_model_len=8192, client_max_concurrency=3,
                                             client_max_active_sessions=6, client_rotation=True,
                                             client_early_stop=True, client_request_rate=1.0))
    config = EngineConfig.from_flat(options)
    result = replay(trace, config, **extra)
    pacing = result.summary["session_pacing"]
    assert pacing["clients"] == 3 and pacing["sessions_per_client"] == 2 and pacing["clients_left"] == 1
    assert (result.requests["status"] == "not_sent").sum() == pacing["turns_not_sent"] > 0
    sent = np.sort(result.requests.loc[result.requests["status"] != "not_sent", "arrival_time_s"].to_numpy())
    ends = np.sort(result.requests["finish_time_s"].dropna().to_numpy())
    assert (np.arange(1, len(sent) + 1) - np.searchsorted(ends, sent, side="left")).max() <= 3
    stepped = replay(trace, config, use_decode_runs=False, **extra)
    pd.testing.assert_frame_equal(result.requests, stepped.requests)


def test_rotation_needs_clients():
    with pytest.raises(ConfigError, match="needs client_max_concurrency"):
        EngineConfig.from_flat({"client_rotation": True})
    with pytest.raises(ConfigError, match="gives none of the 4 clients"):
        EngineConfig.from_flat({"client_rotation": True, "client_max_concurrency": 4, "client_max_active_sessions": 2})


def test_a_request_that_times_out_ends_its_client(benchmark_trace):
    """The script's client leaves once a request failed for good by a time-out (an exception):
    one client sends the script's order up to that request, and nothing after it."""
    requests = _one_client(benchmark_trace, 3, client_timeout_s=0.7)
    order = _sent_order(requests[requests["status"] != "abandoned"])
    timed_out = requests[requests["status"] == "timed_out"]
    assert len(timed_out) == 1
    c, t = timed_out["request_id"].iloc[0].removeprefix("CONV_ID_").split("/turn")
    expected = _script_order(_turns(benchmark_trace), 3)
    assert order == expected[:expected.index((int(c), int(t))) + 1]
    later = requests["request_id"].str.startswith(f"CONV_ID_{c}/") & (
        requests["request_id"].str.split("/turn").str[1].astype(int) > int(t))
    assert (requests.loc[later, "status"] == "abandoned").all() and later.any()


def test_a_warmup_cut_short_leaves_the_conversations_it_did_not_answer(benchmark_trace):
    """With a request cap the warm-up's client leaves after its share: the benchmark proper goes
    on with the conversations the warm-up answered only, from their second turns."""
    requests = _one_client(benchmark_trace, 2, client_warmup=True, client_max_requests=10)
    order = _sent_order(requests)
    assert order[:10] == [(c, 0) for c in range(10)]
    assert {c for c, _ in order[10:]} <= set(range(10)) and all(t >= 1 for _, t in order[10:])
    assert len(order) == 20  # (ten in each phase: the client's share)
