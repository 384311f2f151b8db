"""Randomized batches (hypothesis): mixed context/query lengths, GQA ratios, block sizes, KV splits."""
import pytest
import torch
from kernel_cases import assert_close_to_reference, interpreting, make_batch

from kernels import ref_paged_attention

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.mark.skipif(not interpreting(), reason="CPU Triton needs TRITON_INTERPRET=1")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=3),
    qpk=st.sampled_from([1, 2, 4, 8]),
    block_size=st.sampled_from([16, 32]),
    segments=st.sampled_from([None, 1, 2]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_random_batches(seqs, qpk, block_size, segments, seed):
    from kernels.triton_attention import triton_paged_attention

    batch = make_batch(seqs, num_heads=qpk, num_kv_heads=1, head_size=64, block_size=block_size,
                       dtype=torch.float32, device="cpu", seed=seed)
    out = triton_paged_attention(*batch.args(), num_segments=segments)
    assert_close_to_reference(out, ref_paged_attention(*batch.args()), torch.float32)
