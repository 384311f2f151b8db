"""The paged runner computes the same logits as a plain (non-paged) forward of the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend.runner import ModelRunner
from simkv.config import EngineConfig
from simkv.core.request import Request
from simkv.core.scheduler import Scheduler
from tests.gpu_backend.lockstep import lockstep

transformers = pytest.importorskip("transformers")


def _hf_model(runner: ModelRunner):
    cfg = transformers.LlamaConfig(**runner.model.hf_config_kwargs())
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(runner.model.hf_state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def _plain_logits(model, ids: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.from_numpy(ids)[None]).logits[0, -1]


def test_paged_runner_matches_plain_forward_on_mixed_batches():
    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 48, "block_size": 4,
                                     "max_num_batched_tokens": 24, "max_num_seqs": 8})
    sched = Scheduler(config, 48, detail=True)
    runner = ModelRunner("tiny-llama", 48, block_size=4, device="cpu", dtype="fp32", seed=3)
    hf = _hf_model(runner)
    shared = np.array([11, 12, 13], dtype=np.int64)
    reqs = [Request("a", 0, 0.0, 10, 4), Request("b", 1, 0.0, 17, 3),
            Request("c", 2, 0.0, 30, 3, shared_hash_ids=shared, hash_block_tokens=4),
            Request("d", 3, 0.0, 14, 2, shared_hash_ids=shared, hash_block_tokens=4)]
    for r in reqs:
        sched.add_request(r)
    mixed_steps = compared = sampled_a = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if out.chunks and out.decodes:
            mixed_steps += 1
        batch = runner.prepare(out)
        logits = runner.forward_logits(out)
        for row, (request, position) in enumerate(batch.samplers):
            ids = runner.token_ids(request, 0, position)
            ref = _plain_logits(hf, ids)
            torch.testing.assert_close(logits[row], ref, rtol=1e-4, atol=1e-4)
            compared += 1
        sampled_a = max(sampled_a, len(runner.outputs.get(0, [])))
        sched.update_from_output(out)
    assert mixed_steps >= 1 and compared == sum(r.max_tokens for r in reqs)
    # greedy: the sampled token is the plain forward's argmax, and it is what decodes fed back in
    assert sampled_a == 4
    # a finished request's sampled ids and block table are given up at the next step
    assert runner.outputs and len(runner.block_rows)
    runner.prepare(sched.schedule())
    assert runner.outputs == {} and len(runner.block_rows) == 0


def test_corrupted_pool_changes_logits():
    """The comparison above can fail: poison the pool between steps and the logits move."""
    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 16, "block_size": 4})
    sched = Scheduler(config, 16, detail=True)
    runner = ModelRunner("tiny-llama", 16, block_size=4, device="cpu", dtype="fp32")
    hf = _hf_model(runner)
    r = Request("a", 0, 0.0, 9, 3)
    sched.add_request(r)
    out = sched.schedule()
    runner.run(out)
    sched.update_from_output(out)
    for k, v in runner.kv_caches:
        k[1].normal_()
    out = sched.schedule()
    batch = runner.prepare(out)
    logits = runner.forward_logits(out)
    request, position = batch.samplers[0]
    ref = _plain_logits(hf, runner.token_ids(request, 0, position))
    assert not torch.allclose(logits[0], ref, atol=1e-3)


def test_copy_weights_from_makes_runners_agree():
    """Two runners with different seeds disagree until one takes the other's weights (what the
    CUDA-vs-CPU test relies on: each device draws its own random weights)."""
    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 16, "block_size": 4})
    a = ModelRunner("tiny-llama", 16, block_size=4, device="cpu", dtype="fp32", seed=1)
    b = ModelRunner("tiny-llama", 16, block_size=4, device="cpu", dtype="fp32", seed=2)
    sched = Scheduler(config, 16, detail=True)
    sched.add_request(Request("a", 0, 0.0, 9, 2))
    out = sched.schedule()
    assert not torch.allclose(a.forward_logits(out), b.forward_logits(out))
    b.model.copy_weights_from(a.model)
    torch.testing.assert_close(b.forward_logits(out), a.forward_logits(out))


def test_forward_writes_every_activation_before_reading_it():
    """The eager forward starts from uninitialised activation buffers (no memsets per step):
    with every buffer filled with NaN instead, the logits are unchanged and finite."""
    from gpu_backend.model import Activations

    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 32, "block_size": 4,
                                     "max_num_batched_tokens": 24, "max_num_seqs": 4})
    sched = Scheduler(config, 32, detail=True)
    clean = ModelRunner("tiny-llama", 32, block_size=4, device="cpu", dtype="fp32", seed=4)
    poisoned = ModelRunner("tiny-llama", 32, block_size=4, device="cpu", dtype="fp32", seed=4)
    make = poisoned.model.new_activations

    def nan_activations(num_tokens, zeroed=False):
        act = make(num_tokens, zeroed)
        return Activations(*(t.fill_(float("nan")) for t in (act.hidden, act.residual, act.qkv, act.attn_out,
                                                               act.cos, act.sin)))

    poisoned.model.new_activations = nan_activations
    requests = [Request(str(i), i, 0.0, prompt, out_len) for i, (prompt, out_len) in enumerate([(9, 3), (14, 2), (5, 3)])]
    steps = 0
    for _, a, b in lockstep(sched, requests, clean, poisoned):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        steps += 1
    assert steps >= 3
