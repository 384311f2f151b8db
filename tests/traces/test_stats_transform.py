"""Inspect statistics (reuse ratio semantics) and transform edits."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from simkv.traces import TraceError, trace_from_frame
from simkv.traces.arrivals import ArrivalProcess
from simkv.traces.reuse import prefix_reuse
from simkv.traces.stats import format_stats, trace_stats
from simkv.traces.synth import lognormal
from simkv.traces.transform import Edits, transform


def hashed(prompts: list[int], hashes: list[list[int]], block: int = 4, salts: list | None = None):
    frame = pd.DataFrame({
        "arrival_time_s": np.arange(len(prompts), dtype=float),
        "prompt_tokens": prompts,
        "output_tokens": 1,
        "block_hashes": hashes,
        "hash_block_tokens": block,
    })
    if salts is not None:
        frame["cache_salt"] = salts
    return trace_from_frame(frame)


def test_reuse_counts_partial_last_blocks_by_content_and_length() -> None:
    # Row 1 repeats row 0 exactly (3 blocks at size 4, last one partial): all reused.
    # Row 2 has the same ids but one token more: its partial block (9 tokens) differs, 2 of 3 reused.
    trace = hashed([10, 10, 11], [[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    reuse = prefix_reuse(trace, 4)
    assert (reuse.total_blocks, reuse.reused_blocks, reuse.distinct_first_blocks) == (9, 5, 1)


def test_reuse_needs_the_whole_chain_not_just_the_id() -> None:
    # Block id 2 at level 1 after different first blocks is different content.
    trace = hashed([8, 8, 8], [[1, 2], [7, 2], [1, 2]])
    reuse = prefix_reuse(trace, 4)
    assert reuse.reused_blocks == 2 and reuse.distinct_first_blocks == 2


def test_reuse_at_a_block_size_other_than_the_hash_block() -> None:
    trace = hashed([16, 12, 16], [[1, 2, 3, 4], [1, 2, 3], [1, 2, 9, 9]])
    # at 8-token blocks: row0 (1,2)(1,2,3,4); row1 (1,2)[reused] (1,2,3 L=12)[new]; row2 (1,2)[reused] (1,2,9,9)
    assert prefix_reuse(trace, 8).reused_blocks == 2
    # positions past a hash list are unique: 20 tokens with 2 ids at 4 -> only the first 8 tokens are shareable
    short = hashed([20, 20], [[1, 2], [1, 2]])
    assert prefix_reuse(short, 4).reused_blocks == 2 and prefix_reuse(short, 4).total_blocks == 10


def test_reuse_counts_blocks_an_earlier_reply_holds() -> None:
    # Row 0: 8 prompt tokens and a 9-token reply its 5 ids describe (17 positions, H 4); an
    # engine caches the full blocks of its 16 computed tokens: [8, 12) and [12, 16) are reply
    # blocks. Row 1's 18-token prompt repeats prompt and reply: its blocks 0-3 are reused.
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [8, 18], "output_tokens": [9, 1],
                          "block_hashes": [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]], "hash_block_tokens": [4, 4]})
    reuse = prefix_reuse(trace_from_frame(frame), 4)
    assert (reuse.total_blocks, reuse.reused_blocks) == (7, 4)
    # The same lists cut back to the prompts: only the 2 prompt blocks are reused.
    frame["block_hashes"] = [[1, 2], [1, 2, 3, 4, 5]]
    assert prefix_reuse(trace_from_frame(frame), 4).reused_blocks == 2
    # A later reply is no source for an earlier prompt.
    frame["block_hashes"] = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]
    frame["arrival_time_s"] = [1.0, 0.0]
    assert prefix_reuse(trace_from_frame(frame), 4).reused_blocks == 2


def test_cache_salt_separates_equal_content() -> None:
    trace = hashed([8, 8, 8], [[1, 2], [1, 2], [1, 2]], salts=["a", "b", "a"])
    assert prefix_reuse(trace, 4).reused_blocks == 2


def test_stats_of_req400_and_rates() -> None:
    stats = trace_stats(lognormal())
    assert stats.total_tokens == 276_007 and stats.longest_request_tokens == 2_219
    assert stats.mean_rate_per_s is None and stats.peak_per_s == 400 and stats.reuse_ratio is None
    timed = trace_stats(lognormal(arrival=ArrivalProcess("poisson", 2.0)))
    assert timed.mean_rate_per_min == pytest.approx(timed.mean_rate_per_s * 60)
    assert 1.5 < timed.mean_rate_per_s < 2.5 and timed.peak_per_min >= timed.peak_per_s
    assert "276,007" in format_stats(stats) and "longest request 2,219" in format_stats(stats)


def test_transform_edits_keep_order_and_are_seeded() -> None:
    trace = lognormal(arrival=ArrivalProcess("poisson", 4.0))
    window = transform(trace, Edits(window=(10.0, 20.0)))
    inside = trace.arrival_time_s[(trace.arrival_time_s >= 10) & (trace.arrival_time_s < 20)]
    assert np.allclose(window.arrival_time_s, inside - 10.0)
    assert len(transform(trace, Edits(head=7))) == 7
    scaled = transform(trace, Edits(time_scale=0.5))
    assert np.allclose(scaled.arrival_time_s, trace.arrival_time_s / 2)
    retimed = transform(trace, Edits(rate=100.0, seed=1))
    assert retimed.request_id.tolist() == trace.request_id.tolist()
    assert 3.0 < retimed.arrival_time_s[-1] < 5.0
    sample_a = transform(trace, Edits(sample=0.25, seed=9))
    sample_b = transform(trace, Edits(sample=0.25, seed=9))
    assert sample_a == sample_b and 60 < len(sample_a) < 140
    positions = [int(r) for r in sample_a.request_id]
    assert positions == sorted(positions)
    short = transform(trace, Edits(max_prompt_tokens=500))
    kept = trace.prompt_tokens <= 500
    assert short.request_id.tolist() == trace.request_id[kept].tolist() and 0 < len(short) < len(trace)
    sampled = transform(trace, Edits(samples=8, head=10))
    assert sampled.n.tolist() == [8] * 10 and trace.n is None


@pytest.mark.parametrize(
    ("edits", "expected"),
    [
        (Edits(window=(5.0, 1.0)), "--window"),
        (Edits(head=0), "--head"),
        (Edits(sample=1.5), "--sample"),
        (Edits(time_scale=0.0), "--time-scale"),
        (Edits(rate=-1.0), "--rate"),
        (Edits(max_prompt_tokens=0), "--max-prompt-tokens"),
        (Edits(samples=0), "--samples"),
        (Edits(max_prompt_tokens=1), "left no requests"),
        (Edits(window=(1e9, 2e9)), "left no requests"),
    ],
)
def test_transform_rejects_bad_edits(edits: Edits, expected: str) -> None:
    with pytest.raises(TraceError, match=expected):
        transform(lognormal(arrival=ArrivalProcess("poisson", 4.0)), edits)


def test_link_replies_recovers_the_multi_turn_replies() -> None:
    from simkv.traces.replies import link_replies
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    truth = multi_turn(SessionShape(sessions=30, turns=5), seed=3)
    bare = multi_turn(SessionShape(sessions=30, turns=5, reply_hashes=False), seed=3)
    linked, count = link_replies(bare)
    last_turns = {f"s{s}-t{max(t for t in range(5) if f's{s}-t{t}' in set(truth.request_id))}" for s in range(30)}
    described = 0
    for i, rid in enumerate(truth.request_id):
        if rid in last_turns:  # no next turn repeats it: its list stays the prompt's
            assert np.array_equal(linked.block_hashes(i), bare.block_hashes(i))
        else:
            assert np.array_equal(linked.block_hashes(i), truth.block_hashes(i)), rid
            described += len(truth.block_hashes(i)) > len(bare.block_hashes(i))
    assert count == described > 0


def test_link_replies_needs_the_whole_reply_in_the_next_prompt() -> None:
    from simkv.traces.replies import link_replies

    # Row 1 repeats row 0's 8-token prompt and its 9-token reply (P 20 >= 8 + 9): linked.
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [8, 20], "output_tokens": [9, 1],
                          "block_hashes": [[1, 2], [1, 2, 3, 4, 5]], "hash_block_tokens": [4, 4]})
    linked, count = link_replies(trace_from_frame(frame))
    assert count == 1 and linked.block_hashes(0).tolist() == [1, 2, 3, 4, 5]
    assert linked.session_id.tolist() == ["chain-0", "chain-0"]  # (row 1 waits for row 0's reply)
    # A shorter next prompt (the reply edited before it was sent back): left alone.
    frame["prompt_tokens"] = [8, 16]
    frame["block_hashes"] = [[1, 2], [1, 2, 3, 4]]
    linked, count = link_replies(trace_from_frame(frame))
    assert count == 0 and linked.block_hashes(0).tolist() == [1, 2] and linked.session_id is None


def test_session_history_rebuilds_the_multi_turn_sharing_from_lengths() -> None:
    """simkv's multi-turn synth sends each turn with the conversation so far: content ids rebuilt
    from its lengths and sessions alone reuse what the generator's own ids reuse."""
    from dataclasses import replace

    from simkv.traces.history import session_history
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    truth = multi_turn(SessionShape(sessions=40, turns=5), seed=5)
    bare = replace(truth, hash_ids=None, hash_offsets=None, hash_block_tokens=None)
    rebuilt, linked, prompt_only, later = session_history(bare)
    assert linked == later == len(truth) - 40 and prompt_only == 0  # (every later turn holds the history)
    want, got = prefix_reuse(truth, 16), prefix_reuse(rebuilt, 16)
    assert got.total_blocks == want.total_blocks
    assert abs(got.reused_blocks - want.reused_blocks) <= 0.002 * want.total_blocks
    # each later turn starts with its previous turn's prompt and reply, to the last whole chunk
    for sid in ("s0", "s7"):
        rows = [i for i, s in enumerate(rebuilt.session_id.tolist()) if s == sid]
        for i, j in zip(rows, rows[1:]):
            shared = (truth.prompt_tokens[i] + truth.output_tokens[i]) // 16
            assert rebuilt.block_hashes(j)[:shared].tolist() == rebuilt.block_hashes(i)[:shared].tolist()
            assert len(rebuilt.block_hashes(i)) >= shared
            assert not set(rebuilt.block_hashes(j)[shared:].tolist()) & set(rebuilt.block_hashes(i).tolist())


def test_session_history_leaves_short_turns_and_loose_rows_their_own_content() -> None:
    from simkv.traces.history import session_history

    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0, 2.0, 3.0, 4.0], "prompt_tokens": [40, 30, 100, 8, 10],
                          "output_tokens": [20, 5, 5, 5, 5], "session_id": ["a", None, "a", "a", "a"]})
    rebuilt, linked, prompt_only, later = session_history(trace_from_frame(frame), block_tokens=8)
    # 100 >= 40 + 20: prompt and reply; 8 < 100: a new message only; 8 <= 10 < 8 + 5: the prompt only
    assert (linked, prompt_only, later) == (1, 1, 3)
    assert rebuilt.block_hashes(1).tolist() == []  # (no session: nothing to infer)
    assert rebuilt.block_hashes(2)[:7].tolist() == rebuilt.block_hashes(0).tolist()  # (60 // 8 chunks)
    assert len(rebuilt.block_hashes(2)) == 13 and len(rebuilt.block_hashes(3)) == 1
    assert not set(rebuilt.block_hashes(3).tolist()) & set(rebuilt.block_hashes(2).tolist())
    assert rebuilt.block_hashes(4)[:1].tolist() == rebuilt.block_hashes(3).tolist()  # (8 // 8: its one chunk)
    assert len(rebuilt.block_hashes(3)) == 1 and len(rebuilt.block_hashes(4)) == 2  # (no reply chunk added)
    with pytest.raises(TraceError, match="needs session_id"):
        session_history(trace_from_frame(frame.drop(columns=["session_id"])))
    hashed = frame.assign(block_hashes=[[1], [2], [3], [4], [5]], hash_block_tokens=64)
    with pytest.raises(TraceError, match="has block_hashes"):
        session_history(trace_from_frame(hashed))


def test_a_system_prompt_is_shared_by_every_prompt_long_enough() -> None:
    from simkv.traces.history import session_history, with_system_prompt

    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0, 2.0, 3.0], "prompt_tokens": [40, 12, 100, 30],
                          "output_tokens": [5, 5, 5, 5], "session_id": ["a", "b", "a", "c"]})
    plain = trace_from_frame(frame)
    given, count = with_system_prompt(plain, 20, block_tokens=8)
    assert count == 3  # (row 1's 12 tokens cannot hold it: left without ids)
    assert given.block_hashes(1).tolist() == []
    firsts = {tuple(given.block_hashes(i)[:2].tolist()) for i in (0, 2, 3)}
    assert len(firsts) == 1  # (20 // 8 = 2 shared chunks; the third holds the prompt's end and the row's own)
    rests = [set(given.block_hashes(i)[2:].tolist()) for i in (0, 2, 3)]
    assert not (rests[0] & rests[1]) and not (rests[0] & rests[2]) and not (rests[1] & rests[2])
    assert [len(given.block_hashes(i)) for i in (0, 2, 3)] == [5, 13, 4]
    # after --session-history: the turns keep their history, and every conversation the system prompt
    history, *_ = session_history(plain, block_tokens=8)
    both, _ = with_system_prompt(history, 20, block_tokens=8)
    assert both.block_hashes(2)[:5].tolist() == both.block_hashes(0)[:5].tolist()  # (45 // 8 chunks)
    assert both.block_hashes(3)[:2].tolist() == both.block_hashes(0)[:2].tolist()
    assert both.block_hashes(3)[2] != both.block_hashes(0)[2]
    # a trace with ids of its own at its own chunk size: only the first floor(N / H) are replaced
    hashed = trace_from_frame(pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [64, 64],
                                            "output_tokens": [1, 1], "block_hashes": [[1, 2, 3, 4], [5, 6, 7, 8]],
                                            "hash_block_tokens": [16, 16]}))
    shared, _ = with_system_prompt(hashed, 40, block_tokens=8)
    assert shared.block_hashes(0)[:2].tolist() == shared.block_hashes(1)[:2].tolist()
    assert shared.block_hashes(0)[2:].tolist() == [3, 4] and shared.block_hashes(1)[2:].tolist() == [7, 8]
    assert prefix_reuse(shared, 16).reused_blocks == 2 and prefix_reuse(hashed, 16).reused_blocks == 0
    with pytest.raises(TraceError, match="--system-prompt-tokens must be >= 1"):
        with_system_prompt(plain, 0)


def test_a_rate_profile_retimes_the_trace_piece_by_piece() -> None:
    from simkv.traces.transform import parse_rate_profile

    trace = lognormal(n_requests=6000, seed=3)
    profile = parse_rate_profile("0=2,500=20,600=0,700=5")
    out = transform(trace, Edits(rate_profile=profile, seed=1))
    a = out.arrival_time_s
    assert a[0] == 0 and (np.diff(a) >= 0).all() and np.array_equal(out.prompt_tokens, trace.prompt_tokens)
    counts = np.histogram(a, bins=[0, 500, 600, 700, np.inf])[0]
    assert abs(counts[0] / 500 - 2) < 0.3 and abs(counts[1] / 100 - 20) < 2.5 and counts[2] == 0
    assert abs(counts[3] / (a[-1] - 700) - 5) < 0.3
    again = transform(trace, Edits(rate_profile=profile, seed=1))
    assert np.array_equal(again.arrival_time_s, a)
    for edits, message in ((Edits(rate_profile=((10.0, 1.0),)), "must start at 0"),
                           (Edits(rate_profile=((0.0, 1.0), (5.0, -1.0))), "rates must be >= 0"),
                           (Edits(rate=2.0, rate_profile=((0.0, 1.0),)), "give one"),
                           (Edits(rate_profile=((0.0, 1.0), (10.0, 0.0))), "last rate is 0 from 10 s")):
        with pytest.raises(TraceError, match=message):
            transform(trace, edits)
    with pytest.raises(TraceError, match="expected SECONDS=REQ_PER_S"):
        parse_rate_profile("0=2,600")


def test_inspect_counts_described_replies_and_sessions() -> None:
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=10, turns=3), seed=4)
    stats = trace_stats(trace, 16)
    described = sum(len(trace.block_hashes(i)) * 16 >= trace.prompt_tokens[i] + 16 for i in range(len(trace)))
    assert stats.replies_described == described > 0
    assert (stats.sessions, stats.turns_in_sessions) == (10, len(trace))
    by_session = {}
    for sid, prompt in zip(trace.session_id.tolist(), trace.prompt_tokens.tolist()):
        by_session[sid] = by_session.get(sid, 0) + prompt
    assert stats.max_turns_per_session == 3
    assert stats.largest_session_tokens_share == max(by_session.values()) / trace.prompt_tokens.sum()
    text = format_stats(stats)
    assert f"longest 3 turns; the largest sends {100 * stats.largest_session_tokens_share:.1f} %" in text
    assert f"sessions       10 ({len(trace)} rows" in text and f"replies        {described} rows" in text
    bare = trace_stats(multi_turn(SessionShape(sessions=10, turns=3, reply_hashes=False), seed=4), 16)
    assert bare.replies_described == 0
