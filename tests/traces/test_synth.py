"""Generators: req400 exactness, determinism, arrival processes, shared prefixes, multi-turn sessions."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from simkv.traces import TraceError, write_trace
from simkv.traces.arrivals import ArrivalProcess
from simkv.traces.reuse import prefix_reuse
from simkv.traces.synth import LognormalSizes, lognormal
from simkv.traces.synth_prefix import PrefixGroups, shared_prefix
from simkv.traces.synth_sessions import SessionShape, multi_turn


def test_lognormal_defaults_reproduce_req400_totals() -> None:
    trace = lognormal()
    totals = trace.prompt_tokens + trace.output_tokens
    assert len(trace) == 400
    assert int(totals.sum()) == 276_007
    assert round(float(totals.mean()), 1) == 690.0
    assert int(totals.max()) == 2_219
    assert not trace.arrival_time_s.any()


def test_lognormal_matches_the_article_draw_order() -> None:
    rng = random.Random(7)
    expected = []
    for _ in range(50):
        p = max(min(int(rng.lognormvariate(6.0, 0.7)), 1800), 8)
        o = max(min(int(rng.lognormvariate(4.8, 0.9)), 900), 8)
        expected.append((p, o))
    trace = lognormal(50, 7)
    assert list(zip(trace.prompt_tokens.tolist(), trace.output_tokens.tolist())) == expected


def test_same_seed_same_bytes_and_arrivals_do_not_change_sizes(tmp_path: Path) -> None:
    poisson = ArrivalProcess("poisson", 5.0)
    write_trace(lognormal(300, 11, arrival=poisson), tmp_path / "a.parquet")
    write_trace(lognormal(300, 11, arrival=poisson), tmp_path / "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert np.array_equal(lognormal(300, 11).prompt_tokens, lognormal(300, 11, arrival=poisson).prompt_tokens)


def test_fast_path_is_vectorised_and_within_bounds() -> None:
    sizes = LognormalSizes()
    trace = lognormal(200_000, 3, sizes, fast=True)
    assert len(trace) == 200_000
    assert trace.prompt_tokens.min() >= 8 and trace.prompt_tokens.max() <= 1800
    assert trace.output_tokens.min() >= 8 and trace.output_tokens.max() <= 900
    assert abs(np.median(trace.prompt_tokens) - np.exp(6.0)) < 10  # median of lognormal(6, .7) ~ 403
    assert np.array_equal(lognormal(1000, 3, fast=True).prompt_tokens, lognormal(1000, 3, fast=True).prompt_tokens)


@pytest.mark.slow
def test_fast_path_makes_a_million_requests() -> None:
    trace = lognormal(1_000_000, 1, fast=True, arrival=ArrivalProcess("poisson", 1000.0))
    assert len(trace) == 1_000_000 and bool(np.all(np.diff(trace.arrival_time_s) >= 0))


def test_arrival_processes_have_their_rate_and_burstiness() -> None:
    rng = np.random.default_rng(0)
    poisson = np.diff(ArrivalProcess("poisson", 4.0).times(50_001, rng))
    gamma = np.diff(ArrivalProcess("gamma", 4.0, cv=3.0).times(50_001, rng))
    assert abs(poisson.mean() - 0.25) < 0.01 and abs(poisson.std() / poisson.mean() - 1.0) < 0.05
    assert abs(gamma.mean() - 0.25) < 0.02 and abs(gamma.std() / gamma.mean() - 3.0) < 0.3
    assert not ArrivalProcess().times(5, rng).any()
    with pytest.raises(TraceError, match="needs a rate"):
        ArrivalProcess("poisson")


def test_req400_with_ten_prefix_groups() -> None:
    trace = shared_prefix(PrefixGroups(groups=10, prefix_tokens=(1000,), hash_block_tokens=8))
    base = lognormal()
    assert np.array_equal(trace.prompt_tokens, base.prompt_tokens + 1000)
    assert np.array_equal(trace.output_tokens, base.output_tokens)
    first, eleventh, second = trace.block_hashes(0), trace.block_hashes(10), trace.block_hashes(1)
    assert len(first) == 125 and np.array_equal(first, eleventh) and not set(first) & set(second)
    assert set(trace.hash_block_tokens.tolist()) == {8}
    reuse = prefix_reuse(trace, 16)
    assert reuse.reused_blocks == 390 * 62 and reuse.distinct_first_blocks == 10


def test_shared_prefix_salts_and_block_size_rules() -> None:
    trace = shared_prefix(PrefixGroups(groups=3, prefix_tokens=(96, 48, 0), salt_per_group=True), n_requests=9, seed=1)
    assert trace.cache_salt.tolist()[:3] == ["group-0", "group-1", "group-2"]
    assert trace.hash_block_tokens[0] == 16 and len(trace.block_hashes(0)) == 6 and len(trace.block_hashes(2)) == 0
    with pytest.raises(TraceError, match="multiple of --hash-block-tokens"):
        shared_prefix(PrefixGroups(groups=2, prefix_tokens=(100,), hash_block_tokens=16))
    with pytest.raises(TraceError, match="one --prefix-tokens value or 3"):
        shared_prefix(PrefixGroups(groups=3, prefix_tokens=(16, 32)))


def test_multi_turn_prompts_extend_the_conversation() -> None:
    trace = multi_turn(SessionShape(sessions=5, turns=4, hash_block_tokens=16), seed=2)
    rows = {rid: i for i, rid in enumerate(trace.request_id)}
    for s in range(5):
        for t in range(1, 4):
            prev, cur = rows[f"s{s}-t{t - 1}"], rows[f"s{s}-t{t}"]
            grown = trace.prompt_tokens[cur] - trace.prompt_tokens[prev] - trace.output_tokens[prev]
            assert grown >= 4
            assert trace.arrival_time_s[cur] >= trace.arrival_time_s[prev]
            prev_ids, cur_ids = trace.block_hashes(prev), trace.block_hashes(cur)
            assert np.array_equal(cur_ids[: len(prev_ids)], prev_ids)
            # the list goes on over the turn's reply, which the next prompt repeats
            assert len(cur_ids) == -(-(trace.prompt_tokens[cur] + trace.output_tokens[cur]) // 16)
    assert not set(trace.block_hashes(rows["s0-t0"])) & set(trace.block_hashes(rows["s1-t0"]))


def test_multi_turn_without_reply_hashes_lists_the_prompts_only() -> None:
    shape = SessionShape(sessions=5, turns=4, hash_block_tokens=16)
    with_replies = multi_turn(shape, seed=2)
    trace = multi_turn(SessionShape(sessions=5, turns=4, hash_block_tokens=16, reply_hashes=False), seed=2)
    assert np.array_equal(trace.prompt_tokens, with_replies.prompt_tokens)
    for i in range(len(trace)):
        ids = trace.block_hashes(i)
        assert len(ids) == -(-trace.prompt_tokens[i] // 16)
        assert np.array_equal(ids, with_replies.block_hashes(i)[: len(ids)])


def test_multi_turn_stops_sessions_at_the_prompt_cap() -> None:
    trace = multi_turn(SessionShape(sessions=20, turns=50, max_prompt_tokens=3000), seed=4)
    assert trace.prompt_tokens.max() <= 3000
    assert len(trace) < 20 * 50
