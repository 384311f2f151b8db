"""Steps with prefill chunks on piecewise, padded buffers (the piecewise-CUDA-graph path) compute
what the eager forward does."""

from __future__ import annotations

import pytest
import torch

from gpu_backend.piecewise_graphs import piecewise_sizes
from gpu_backend.runner import ModelRunner
from tests.gpu_backend.lockstep import lockstep
from simkv.config import EngineConfig
from simkv.core.request import Request
from simkv.core.scheduler import Scheduler

SIZES = [1, 2, 4, 8, 16]  # small ladder: the test's steps (up to 20 tokens) meet padding and the eager fallback


def test_piecewise_sizes_follow_vllm_ladder():
    assert piecewise_sizes(512) == [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
    assert piecewise_sizes(100) == [1, 2, 4] + list(range(8, 105, 8))
    assert piecewise_sizes(1) == [1]
    assert piecewise_sizes(300)[-1] == 304


def _run_both(device: str, dtype: str, capture: bool, kernel_backend: str | None = None, share_tokens: bool = False,
              decode_graphs: bool = False):
    """The same schedule on an eager runner and on one with piecewise graphs (or their buffers run eagerly)."""
    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 64, "block_size": 4,
                                     "max_num_batched_tokens": 20, "max_num_seqs": 8})
    sched = Scheduler(config, 64, detail=True)
    eager = ModelRunner("tiny-llama", 64, block_size=4, device=device, dtype=dtype, seed=7, kernel_backend=kernel_backend)
    pieces = ModelRunner("tiny-llama", 64, block_size=4, device=device, dtype=dtype, seed=7, kernel_backend=kernel_backend)
    if decode_graphs:
        pieces.enable_decode_graphs(8, capture=capture)
    status = pieces.enable_piecewise_graphs(16, capture=capture, sizes=SIZES)
    assert pieces.piecewise_graphs is not None, status
    requests = [Request(str(i), i, 0.0, prompt, out_len)
                for i, (prompt, out_len) in enumerate([(5, 9), (9, 6), (13, 11), (3, 4), (17, 3), (40, 2)])]
    rows = []
    for out, a, b in lockstep(sched, requests, eager, pieces, share_tokens):
        tokens = out.num_prefill_tokens + out.num_decode_reqs
        rows.append((a, b, tokens, bool(out.chunks), pieces.last_piecewise_tokens, pieces.last_graph_batch))
    return rows, eager, pieces


@pytest.mark.parametrize("decode_graphs", [False, True], ids=["piecewise only", "with decode graphs"])
def test_piecewise_buffers_match_eager_forward(decode_graphs):
    rows, eager, pieces = _run_both("cpu", "fp32", capture=False, decode_graphs=decode_graphs)
    for a, b, *_ in rows:
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert pieces.outputs == eager.outputs  # the same greedy tokens were fed back
    for _, _, tokens, mixed, padded_to, graph_batch in rows:
        if decode_graphs and not mixed:
            assert padded_to == 0 and graph_batch > 0  # decode-only steps take the full graphs first
        elif tokens <= SIZES[-1]:
            assert padded_to == next(s for s in SIZES if s >= tokens)
        else:
            assert padded_to == 0  # too many tokens for the largest piecewise size: eager
    padded = [(t, p) for _, _, t, _, p, _ in rows if p]
    assert any(p > t for t, p in padded) and any(p == 0 for *_, p, _ in rows), rows  # both paths met
    assert pieces.piecewise_sizes == [] and "static buffers" in pieces.piecewise_status


def test_piecewise_graphs_need_cuda():
    runner = ModelRunner("tiny-llama", 16, block_size=4, device="cpu", dtype="fp32")
    with pytest.raises(ValueError, match="CUDA"):
        runner.enable_piecewise_graphs(16, capture=True)
    assert runner.piecewise_status == "off"


@pytest.mark.cuda
def test_captured_piecewise_graphs_match_eager_forward():
    rows, eager, pieces = _run_both("cuda", "bf16", capture=True, share_tokens=True, decode_graphs=True)
    assert pieces.piecewise_graphs.captured and pieces.piecewise_sizes == SIZES
    assert any(p for *_, p, _ in rows)
    for a, b, *_ in rows:
        torch.testing.assert_close(b.float(), a.float(), rtol=0.02, atol=0.02)


def test_path_of_each_step_is_what_the_cost_model_assumes():
    """The runner records, per step, the decode-graph size or the piecewise token count it ran
    as; the calibrated cost model, given the two ladders, infers both from the step's shape."""
    from gpu_backend.decode_graphs import capture_sizes
    from simkv.calibration.costmodel import COEFFICIENTS, CalibratedCostModel, effective_features

    rows, _, _ = _run_both("cpu", "fp32", capture=False, decode_graphs=True)
    model = CalibratedCostModel(dict.fromkeys(COEFFICIENTS, 1.0), 1.0, graph_sizes=capture_sizes(8),
                                piecewise_sizes=SIZES)
    for _, _, tokens, mixed, padded_to, graph_batch in rows:
        expect_graph = 0 if mixed else model.graph_batch(tokens)
        assert graph_batch == expect_graph
        assert padded_to == (0 if expect_graph else model.piecewise_tokens(tokens))
    # the vectorised features agree: a decode step (Kp = 0) and a chunk step (Kp > 0) of each size
    feats = [[t, 1, 0 if not mixed else t, 1 if mixed else 0, 0] for _, _, t, mixed, _, _ in rows]
    e, w, t, *_ = effective_features(feats, capture_sizes(8), SIZES)
    for (_, _, tokens, mixed, padded_to, graph_batch), ei, wi, ti in zip(rows, e, w, t):
        assert (wi == 1) == (padded_to > 0) and (ei == 1) == (padded_to == 0 and graph_batch == 0)
        assert ti == (padded_to or graph_batch or tokens)


def test_a_capture_cut_short_keeps_the_largest_size_then_the_powers_of_two():
    from gpu_backend.piecewise_graphs import capture_order, piecewise_sizes

    sizes = piecewise_sizes(512)
    order = capture_order(sizes)
    assert sorted(order) == sorted(sizes) and order[0] == 512
    assert order[1:10] == [256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert order[10:] == sorted((s for s in sizes if s & (s - 1)), reverse=True)
