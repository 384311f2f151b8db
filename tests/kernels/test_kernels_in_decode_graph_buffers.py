"""The Triton kernels on the decode-graph path: padded static buffers, pad rows on the null block,
a tile configuration chosen for the longest context (more KV segments than the batch needs).
Runs under the interpreter on CPU (the CUDA-graph capture itself is tested on CUDA in
tests/gpu_backend/test_decode_graphs.py)."""
import pytest
import torch
from kernel_cases import interpreting

from tests.gpu_backend.lockstep import lockstep

# CPU tensors through the Triton kernels: the interpreter only (on a GPU host the compiled
# kernels run this path inside captured graphs: tests/gpu_backend/test_decode_graphs.py)
pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tensors)")


def test_triton_kernels_on_padded_static_decode_buffers_match_reference_runner():
    from gpu_backend.runner import ModelRunner
    from simkv.config import EngineConfig
    from simkv.core.request import Request
    from simkv.core.scheduler import Scheduler

    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 40, "block_size": 16,
                                     "max_num_batched_tokens": 64, "max_num_seqs": 6})
    sched = Scheduler(config, 40, detail=True)
    ref = ModelRunner("tiny-llama", 40, 16, "cpu", "fp32", seed=11, kernel_backend="torch")
    tri = ModelRunner("tiny-llama", 40, 16, "cpu", "fp32", seed=11, kernel_backend="triton")
    tri.enable_decode_graphs(6, capture=False)  # static buffers, padded to 1, 2, 4, 8
    for k, v in tri.kv_caches:  # never-written slots (the null block that pad rows read included) are NaN
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    used = []
    run = tri.decode_graphs.run
    tri.decode_graphs.run = lambda batch: used.append(len(batch.seq_lens)) or run(batch)
    requests = [Request(str(i), i, 0.0, prompt, out_len)
                for i, (prompt, out_len) in enumerate([(9, 5), (17, 4), (3, 6), (30, 3), (16, 4)])]
    for _, a, b in lockstep(sched, requests, ref, tri):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert used and any(n in (3, 5, 6, 7) for n in used), used  # padded batches went through the kernels


def test_triton_kernels_on_padded_piecewise_buffers_match_reference_runner():
    """The fused layer ops and the planned attention inside the piecewise pieces (padded token
    counts, stale pad rows) under the interpreter, against the all-torch eager runner."""
    from gpu_backend.runner import ModelRunner
    from simkv.config import EngineConfig
    from simkv.core.request import Request
    from simkv.core.scheduler import Scheduler

    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 40, "block_size": 16,
                                     "max_num_batched_tokens": 24, "max_num_seqs": 6})
    sched = Scheduler(config, 40, detail=True)
    ref = ModelRunner("tiny-llama", 40, 16, "cpu", "fp32", seed=11, kernel_backend="torch")
    tri = ModelRunner("tiny-llama", 40, 16, "cpu", "fp32", seed=11, kernel_backend="triton")
    tri.enable_piecewise_graphs(16, capture=False, sizes=[4, 8, 16])
    for k, v in tri.kv_caches:  # never-written slots are NaN: pad rows must not write or be read
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    padded = []
    requests = [Request(str(i), i, 0.0, prompt, out_len) for i, (prompt, out_len) in enumerate([(9, 3), (17, 2), (3, 3), (30, 2)])]
    for out, a, b in lockstep(sched, requests, ref, tri):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        padded.append((out.num_prefill_tokens + out.num_decode_reqs, tri.last_piecewise_tokens))
    assert any(p > n for n, p in padded) and any(p == 0 for _, p in padded), padded
