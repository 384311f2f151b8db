"""Decode steps on static, padded buffers (the CUDA-graph path) compute what the eager forward does."""

from __future__ import annotations

import pytest
import torch

from gpu_backend.decode_graphs import capture_sizes
from gpu_backend.runner import ModelRunner
from tests.gpu_backend.lockstep import lockstep
from simkv.config import EngineConfig
from simkv.core.request import Request
from simkv.core.scheduler import Scheduler


def test_capture_sizes_follow_vllm_ladder():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(12) == [1, 2, 4, 8, 16]


def _run_both(device: str, dtype: str, capture: bool, max_batch: int = 8, share_tokens: bool = False):
    """The same schedule on an eager runner and on one with decode graphs (or static buffers)."""
    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 64, "block_size": 4,
                                     "max_num_batched_tokens": 32, "max_num_seqs": max_batch})
    sched = Scheduler(config, 64, detail=True)
    eager = ModelRunner("tiny-llama", 64, block_size=4, device=device, dtype=dtype, seed=7)
    graphed = ModelRunner("tiny-llama", 64, block_size=4, device=device, dtype=dtype, seed=7)
    status = graphed.enable_decode_graphs(max_batch, capture=capture)
    graphed.step_graph_batches = []
    assert graphed.decode_graphs is not None, status
    used = []
    run = graphed.decode_graphs.run
    graphed.decode_graphs.run = lambda batch: used.append(len(batch.seq_lens)) or run(batch)
    requests = [Request(str(i), i, 0.0, prompt, out_len)
                for i, (prompt, out_len) in enumerate([(5, 9), (9, 6), (13, 11), (3, 4), (17, 3)])]
    pairs = []
    for out, a, b in lockstep(sched, requests, eager, graphed, share_tokens):
        pairs.append((a, b, bool(out.chunks)))
        graphed.step_graph_batches.append((out.num_decode_reqs, bool(out.chunks), graphed.last_graph_batch))
    return pairs, used, eager, graphed


def test_static_padded_decode_matches_eager_forward():
    pairs, used, eager, graphed = _run_both("cpu", "fp32", capture=False)
    assert used and any(n not in capture_sizes(8) for n in used), used  # some batches were padded
    assert sum(1 for *_, mixed in pairs if not mixed) == len(used)  # every decode-only step took the path
    for a, b, _ in pairs:
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert graphed.outputs == eager.outputs  # the same greedy tokens were fed back


def test_graph_batch_of_each_step_is_what_the_cost_model_assumes():
    """The runner records the graph size each step ran as; the calibrated cost model, given the
    captured sizes, infers the same from the step's shape alone."""
    from simkv.calibration.costmodel import COEFFICIENTS, CalibratedCostModel

    _, used, eager, graphed = _run_both("cpu", "fp32", capture=False)
    assert graphed.graph_sizes == [] and eager.last_graph_batch == 0  # static buffers save no launches
    model = CalibratedCostModel(dict.fromkeys(COEFFICIENTS, 1.0), 1.0, graph_sizes=capture_sizes(8))
    rows = graphed.step_graph_batches
    assert [b for _, _, b in rows if b] == [model.graph_batch(n) for n in used]
    for decodes, mixed, batch in rows:
        assert batch == (0 if mixed else model.graph_batch(decodes))


def test_graphs_need_cuda():
    runner = ModelRunner("tiny-llama", 16, 16, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        runner.enable_decode_graphs(4, capture=True)
    assert runner.decode_graphs_status == "off"


@pytest.mark.cuda
def test_captured_decode_graphs_match_eager_forward():
    pairs, used, eager, graphed = _run_both("cuda", "bf16", capture=True, share_tokens=True)
    assert graphed.decode_graphs.captured and used
    for a, b, _ in pairs:
        torch.testing.assert_close(b.float(), a.float(), rtol=0.02, atol=0.02)


def test_sibling_runner_shares_weights_not_the_kv_pool():
    """Calibration steps timed alongside a replay run on a sibling: same weights and kernels, a
    pool of its own, so they never write into the replay's requests' blocks."""
    from gpu_backend.synthetic import run_synthetic, synthetic_output

    runner = ModelRunner("tiny-llama", 32, 16, "cpu", "fp32", seed=2)
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    sib = runner.sibling(24)
    assert sib.model is runner.model and sib.num_gpu_blocks == 24 and runner.num_gpu_blocks == 32
    for k, v in sib.kv_caches:
        k.zero_()
        v.zero_()
    run_synthetic(sib, synthetic_output([(0, 20)], [30, 5], 16, 24))
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert any(k.abs().sum() > 0 for k, _ in sib.kv_caches)  # the sibling's own pool was written
    assert sib.outputs is not runner.outputs and sib.decode_graphs is None
