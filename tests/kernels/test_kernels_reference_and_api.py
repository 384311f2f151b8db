"""The torch reference itself, the public dispatch API, and a randomized property check."""
import pytest
import torch
from kernel_cases import assert_close_to_reference, interpreting, make_batch

import kernels
from kernels import paged_attention, ref_paged_attention, ref_reshape_and_cache, reshape_and_cache, select_backend
from kernels.layout import slot_mapping_for


@pytest.mark.parametrize("qpk", [1, 4])
def test_reference_matches_sdpa_on_contiguous_kv(qpk):
    """ref_paged_attention == torch SDPA with an explicit causal-with-offset mask."""
    seqs = [(0, 6), (13, 1), (5, 4)]
    batch = make_batch(seqs, num_heads=2 * qpk, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.float32, device="cpu", seed=11)
    out = ref_paged_attention(*batch.args())
    qsl = batch.query_start_loc.tolist()
    for i, (ctx, q_len) in enumerate(seqs):
        seq_len = ctx + q_len
        nb = -(-seq_len // 16)
        blocks = batch.block_tables[i, :nb].long()
        k = batch.key_cache[blocks].reshape(-1, 2, 64)[:seq_len].transpose(0, 1)
        v = batch.value_cache[blocks].reshape(-1, 2, 64)[:seq_len].transpose(0, 1)
        k, v = k.repeat_interleave(qpk, 0), v.repeat_interleave(qpk, 0)
        q = batch.query[qsl[i]:qsl[i + 1]].transpose(0, 1)
        mask = torch.arange(seq_len)[None, :] <= torch.arange(ctx, seq_len)[:, None]
        expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], expect.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_reference_cache_write_then_attention_roundtrip():
    """Writing a prompt with ref_reshape_and_cache then attending equals plain causal attention."""
    torch.manual_seed(0)
    hkv, h, d, bs, n = 1, 2, 64, 16, 21
    kc = torch.full((5, bs, hkv, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    table = [3, 0]
    slots = torch.tensor(slot_mapping_for(table, range(n), bs), dtype=torch.int64)
    k, v, q = torch.randn(n, hkv, d), torch.randn(n, hkv, d), torch.randn(n, h, d)
    ref_reshape_and_cache(k, v, kc, vc, slots)
    out = ref_paged_attention(q, kc, vc, torch.tensor([table], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                              torch.tensor([0, n], dtype=torch.int32), d ** -0.5)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).expand(h, n, d), v.transpose(0, 1).expand(h, n, d), is_causal=True)
    torch.testing.assert_close(out, expect.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_select_backend(monkeypatch):
    monkeypatch.setenv("SIMKV_KERNEL_BACKEND", "torch")
    assert select_backend("cpu") == "torch"
    monkeypatch.delenv("SIMKV_KERNEL_BACKEND")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expect_cuda = "triton" if kernels.triton_available() else "torch"
    assert select_backend("cpu") == "torch"
    if torch.cuda.is_available():
        assert select_backend("cuda") == expect_cuda
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("cpu") == expect_cuda


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_public_api_dispatch(backend, monkeypatch):
    if backend == "triton" and not interpreting():
        pytest.skip("CPU Triton needs TRITON_INTERPRET=1")
    monkeypatch.setenv("SIMKV_KERNEL_BACKEND", backend)
    batch = make_batch([(5, 2), (0, 3)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.float16, device="cpu", seed=12)
    out = paged_attention(*batch.args(), max_query_len=3, max_seq_len=7)
    assert_close_to_reference(out, ref_paged_attention(*batch.args()), torch.float16)
    kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
    key = torch.randn(2, 2, 64).half()
    slots = torch.tensor([-1, 40], dtype=torch.int64)
    reshape_and_cache(key, key, kc, vc, slots)
    assert torch.equal(kc[2, 8], key[1]) and torch.equal(vc[2, 8], key[1])
