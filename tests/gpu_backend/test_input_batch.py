"""The runner's step inputs, built from block tables kept across steps, equal the inputs built
from scratch every step, through preemption (recompute, restart, swap), prefix caching, chunked
prefill, copy-on-write of forked sequences and lookahead slots."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_backend.input_batch import BlockTableRows
from gpu_backend.runner import ModelRunner
from simkv.core.request import Request
from simkv.core.scheduler import Scheduler
from tests.core.helpers import make_config

FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices")


def scratch_inputs(runner, output) -> dict:
    """Every array of a step built request by request from the lists the scheduler hands over
    (the runner's former `prepare`, kept as the oracle)."""
    bs = runner.block_size
    work = [(c.request, c.num_computed_tokens, c.num_new_tokens, c.block_ids, False) for c in output.chunks]
    work += [(d.request, d.num_computed_tokens, 1, d.block_ids, True) for d in (output.decodes or ())]
    width = max((len(w[3]) for w in work), default=1) or 1
    ids, poss, slots, lens, qsl, tables, logits_idx, samplers, t = [], [], [], [], [0], [], [], [], 0
    for request, computed, new, block_ids, is_decode in work:
        end = computed + new
        pos = np.arange(computed, end, dtype=np.int64)
        table = np.asarray(block_ids, dtype=np.int64)
        ids.append(runner.token_ids(request, computed, end))
        poss.append(pos)
        slots.append(table[pos // bs] * bs + pos % bs)
        row = np.zeros(width, dtype=np.int32)
        row[:len(table)] = table
        tables.append(row)
        lens.append(end)
        t += new
        qsl.append(t)
        if is_decode or end >= request.num_prompt_tokens + request.num_output_tokens:
            logits_idx.append(t - 1)
            samplers.append((request, end))
    cat = lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)  # noqa: E731
    return {"input_ids": cat(ids, np.int64), "positions": cat(poss, np.int64), "slot_mapping": cat(slots, np.int64),
            "block_tables": np.stack(tables) if tables else np.zeros((0, 1), np.int32),
            "seq_lens": np.asarray(lens, dtype=np.int32), "query_start_loc": np.asarray(qsl, dtype=np.int32),
            "logits_indices": np.asarray(logits_idx, dtype=np.int64), "samplers": samplers,
            "max_seq_len": max(lens, default=0)}


def replay_and_compare(sched: Scheduler, requests: list[Request], block_size: int, seed: int = 0) -> dict:
    """Run `requests` through `sched`; at every step compare the runner's inputs with the
    scratch build (sampling random tokens so later steps read them back). Returns event counts."""
    runner = ModelRunner("tiny-llama", 0, block_size=block_size, max_model_len=4096)
    rng = np.random.default_rng(seed)
    for r in requests:
        sched.add_request(r)
    counts = {"steps": 0, "preempted": 0, "rewritten": 0, "mixed": 0}
    last_tables: dict = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert not out.is_empty, "engine stuck"
        batch = runner.prepare(out)
        ref = scratch_inputs(runner, out)
        for name in FIELDS:
            got, want = getattr(batch, name), ref[name]
            assert got.dtype == want.dtype and np.array_equal(got, want), (out.step, name, got, want)
        assert [(id(r), p) for r, p in batch.samplers] == [(id(r), p) for r, p in ref["samplers"]]
        assert batch.max_seq_len == ref["max_seq_len"]
        assert batch.max_query_len == int(np.diff(ref["query_start_loc"]).max(initial=0))
        for request, position in batch.samplers:
            runner._record_sample(request, position, int(rng.integers(runner.vocab)))
        # a table that changed other than by growing (a preempted request's new blocks, a copy on write)
        for item in list(out.chunks) + list(out.decodes or ()):
            before = last_tables.get(id(item.request))
            if before is not None and list(item.block_ids[:len(before)]) != before:
                counts["rewritten"] += 1
            last_tables[id(item.request)] = list(item.block_ids)
        counts["steps"] += 1
        counts["preempted"] += len(out.preempted)
        counts["mixed"] += bool(out.chunks and out.decodes)
        sched.update_from_output(out)
    counts["rows_left"] = len(runner.block_rows)
    return counts


def _requests(sizes, shared=None, h=0, n=1):
    ids = None if shared is None else np.asarray(shared, dtype=np.int64)
    return [Request(f"r{i}", i, 0.0, p, o, shared_hash_ids=ids, hash_block_tokens=h, num_samples=n)
            for i, (p, o) in enumerate(sizes)]


SIZES = [(37, 30), (5, 41), (64, 12), (18, 25), (50, 20), (9, 33), (23, 17)]


def test_equal_inputs_under_recompute_preemption_and_chunked_prefill():
    config = make_config(num_gpu_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=128)
    counts = replay_and_compare(Scheduler(config, 24, detail=True), _requests(SIZES), 4)
    assert counts["preempted"] > 0 and counts["rewritten"] > 0 and counts["mixed"] > 0, counts
    # finished requests gave their rows up: at most the last step's requests still hold one
    assert counts["rows_left"] <= 6


def test_equal_inputs_under_restart_and_swap_preemption():
    for mode, cpu_blocks in (("restart", 0), ("swap", 40)):
        config = make_config(num_gpu_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=48,
                             max_model_len=128, preemption_mode=mode)
        sched = Scheduler(config, 20, detail=True, num_cpu_blocks=cpu_blocks)
        counts = replay_and_compare(sched, _requests(SIZES), 4)
        assert counts["preempted"] > 0 and counts["rewritten"] > 0, (mode, counts)
    assert sched.num_swap_outs > 0


def test_equal_inputs_with_prefix_hits_and_forked_sequences():
    shared = [101, 102, 103, 104, 105]
    config = make_config(num_gpu_blocks=64, block_size=4, max_num_seqs=12, max_num_batched_tokens=40, max_model_len=128,
                         parallel_sampling="fork")
    sched = Scheduler(config, 64, detail=True)
    requests = _requests([(19, 9), (22, 14), (13, 6)], shared=shared, h=4, n=3)
    counts = replay_and_compare(sched, requests, 4)
    assert counts["rewritten"] > 0, counts  # copy-on-write of the shared last prompt block
    assert sched.kv_cache_manager.block_pool is not None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40)), min_size=1, max_size=8),
       blocks=st.integers(12, 40), block_size=st.sampled_from([2, 4, 8]), budget=st.integers(8, 64),
       mode=st.sampled_from(["recompute", "restart", "swap"]), n=st.sampled_from([1, 1, 2]),
       lookahead=st.sampled_from([0, 0, 3]), share=st.booleans(), seed=st.integers(0, 9),
       sampling=st.sampled_from(["fan_out", "fork"]))
def test_equal_inputs_on_random_workloads(sizes, blocks, block_size, budget, mode, n, lookahead, share, seed, sampling):
    config = make_config(num_gpu_blocks=blocks, block_size=block_size, max_num_seqs=6, max_num_batched_tokens=budget,
                         max_model_len=256, preemption_mode=mode, num_lookahead_tokens=lookahead,
                         parallel_sampling=sampling)
    sched = Scheduler(config, blocks, detail=True, num_cpu_blocks=16 if mode == "swap" else 0)
    requests = _requests(sizes, shared=[7, 8, 9, 10] if share else None, h=block_size if share else 0, n=n)
    for r in requests:  # a request that can never fit is refused by the engine; keep the ones that can
        r.max_tokens = min(r.max_tokens, 100)
    fits = [r for r in requests if -(-(r.num_prompt_tokens + r.max_tokens + lookahead) // block_size) * n < blocks - 2]
    if fits:
        replay_and_compare(sched, fits, block_size, seed)


def test_block_table_rows_append_and_rebuild():
    rows = BlockTableRows()
    a, b = object(), object()
    assert rows.sync(a, [5, 6], 1).tolist() == [5, 6]
    assert rows.sync(a, [5, 6, 9], 2).tolist() == [5, 6, 9]  # grew by one block
    long = list(range(100, 160))
    assert rows.sync(a, [5, 6, 9] + long, 62).tolist() == [5, 6, 9] + long  # past the first capacity
    assert rows.sync(a, [7, 8], 1).tolist() == [7, 8]  # shorter: rebuilt
    assert rows.sync(a, [7, 3], 1).tolist() == [7, 3]  # same length, last block replaced (copy on write)
    assert rows.sync(a, [7, 3, 4], 2).tolist() == [7, 3, 4]
    assert rows.sync(a, [1, 2, 5, 6], 3).tolist() == [1, 2, 5, 6]  # the kept last block moved: rebuilt
    # lookahead slots: the step writes into entry 1, copied on write, while the last entry stays
    assert rows.sync(a, [1, 8, 5, 6], 1).tolist() == [1, 8, 5, 6]
    # Only the written entry and the last are compared (O(1) per request and step): a rewrite
    # elsewhere goes unseen. The engine never makes one; a preemption drops the row first.
    assert rows.sync(a, [9, 9, 5, 6, 7], 4).tolist() == [1, 8, 5, 6, 7]
    assert rows.sync(b, [], 0).tolist() == [] and len(rows) == 2
    rows.drop(a)
    rows.drop(a)
    assert len(rows) == 1


def test_forked_sequence_with_lookahead_copies_a_block_before_its_last():
    """The case hypothesis found: a prompt of one token, two samples, lookahead slots. After the
    fork both sequences hold [b0, b1] (b1 for the lookahead); the first decode writes into the
    shared b0, and the copy on write changes entry 0 of one table, not its last entry."""
    config = make_config(num_gpu_blocks=12, block_size=2, max_num_seqs=6, max_num_batched_tokens=8,
                         max_model_len=256, num_lookahead_tokens=3, parallel_sampling="fork")
    counts = replay_and_compare(Scheduler(config, 12, detail=True), _requests([(1, 2)], n=2), 2)
    assert counts["rewritten"] > 0, counts


def test_a_rewritten_table_without_a_preemption_signal_is_still_rebuilt():
    """The rows do not depend on `preempted` alone: a list that does not extend the kept row
    (same length, different last block) is taken whole."""
    from gpu_backend.synthetic import synthetic_output

    runner = ModelRunner("tiny-llama", 0, block_size=4)
    out = synthetic_output([], [9, 9], 4, 64)
    first = runner.prepare(out).block_tables.copy()
    out.decodes[1].block_ids = [50, 51, 52]
    second = runner.prepare(out).block_tables
    assert second[0].tolist() == first[0].tolist() and second[1].tolist() == [50, 51, 52]


def test_missing_block_ids_are_refused():
    from gpu_backend.synthetic import synthetic_output

    runner = ModelRunner("tiny-llama", 0, block_size=4)
    out = synthetic_output([(0, 5)], [9], 4, 64)
    out.decodes[0].block_ids = None
    with pytest.raises(ValueError, match="detail=True"):
        runner.prepare(out)
