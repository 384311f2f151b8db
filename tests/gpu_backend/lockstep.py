"""Two model runners fed the same schedule, step by step (the tests that compare a runner with a
reference runner: CUDA graphs, piecewise graphs, fused kernels, devices)."""

from __future__ import annotations


def lockstep(sched, requests, reference, other, share_tokens: bool = False):
    """Add `requests` to `sched` and run its steps on both runners; yields (step output, the
    reference's logits, the other's logits) before each step's update. `share_tokens`: feed the
    other runner the reference's sampled tokens (bf16 near-ties may sample differently)."""
    for request in requests:
        sched.add_request(request)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        yield out, reference.forward_logits(out), other.forward_logits(out)
        if share_tokens:
            other.outputs = {k: list(v) for k, v in reference.outputs.items()}
        sched.update_from_output(out)
