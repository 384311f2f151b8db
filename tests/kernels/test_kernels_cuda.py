"""CUDA-only kernel tests: bf16, realistic shapes, and pools beyond 32-bit element offsets.

Skipped without a GPU.  ``scripts/gpu_check.sh`` runs them on the GPU host.
"""
import pytest
import torch
from kernel_cases import assert_close_to_reference, make_batch, new_kv_of

from kernels import ref_paged_attention, ref_reshape_and_cache
from kernels.triton_attention import AttentionConfig, choose_config, triton_paged_attention
from kernels.triton_cache import triton_reshape_and_cache

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.mark.parametrize("qpk", [1, 4, 8])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (80, 32), (96, 16), (128, 32)])
def test_bf16_mixed_batch(qpk, head_size, block_size):
    bs = block_size
    seqs = [(0, 1), (bs - 1, 1), (bs, 1), (0, bs + 1), (2 * bs + 3, 7), (5, 70)]
    batch = make_batch(seqs, num_heads=2 * qpk, num_kv_heads=2, head_size=head_size, block_size=bs,
                       dtype=torch.bfloat16, device="cuda", seed=qpk)
    out = triton_paged_attention(*batch.args())
    assert_close_to_reference(out, ref_paged_attention(*batch.args()), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_llama_like_shapes(dtype, block_size):
    """32 query heads / 8 KV heads / head 128: long prefill, chunked prefill and decodes together."""
    seqs = [(0, 1000), (3000, 1), (2000, 300), (100, 1), (0, 1), (511, 513), (4095, 1)]
    batch = make_batch(seqs, num_heads=32, num_kv_heads=8, head_size=128, block_size=block_size,
                       dtype=dtype, device="cuda", seed=block_size)
    out = triton_paged_attention(*batch.args())
    assert_close_to_reference(out, ref_paged_attention(*batch.args()), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_batch_uses_split_kv(dtype):
    """Few long decodes: the heuristic splits the key range; result equals the reference."""
    seqs = [(8000, 1), (300, 1), (16383, 1)]
    batch = make_batch(seqs, num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                       dtype=dtype, device="cuda", seed=9)
    cfg = choose_config(qpk=4, head_pad=128, elem_size=2, num_seqs=3, num_kv_heads=8, max_query_len=1,
                        max_seq_len=16384, num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    assert cfg.num_segments > 1
    out = triton_paged_attention(*batch.args())
    assert_close_to_reference(out, ref_paged_attention(*batch.args()), dtype)


@pytest.mark.parametrize("tile_n,block_m,segments,stages,prefetch", [
    (16, 16, 1, 2, False), (32, 64, 1, 2, False), (128, 128, 1, 2, False), (64, 16, 8, 2, False),
    (64, 16, 8, 3, True), (64, 128, 1, 3, True), (16, 64, 1, 4, True)])
def test_explicit_configs(tile_n, block_m, segments, stages, prefetch):
    seqs = [(0, 200), (1000, 1), (77, 50)]
    batch = make_batch(seqs, num_heads=16, num_kv_heads=2, head_size=128, block_size=16,
                       dtype=torch.float16, device="cuda", seed=tile_n)
    cfg = AttentionConfig(block_m=block_m, tile_n=tile_n, num_segments=segments, num_warps=4, num_stages=stages,
                          prefetch_ids=prefetch)
    out = triton_paged_attention(*batch.args(), config=cfg)
    assert_close_to_reference(out, ref_paged_attention(*batch.args()), torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tma_configs_compiled(dtype):
    """The TMA options compiled, llama-like GQA in bf16 and fp16: cache blocks by TMA for a
    decode batch (split and not), the new tokens' K/V by TMA for prefills after a context."""
    seqs = [(0, 300), (1000, 1), (77, 50), (4000, 1)]
    batch = make_batch(seqs, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=dtype,
                       device="cuda", seed=21)
    key, value = new_kv_of(batch, seqs, fused_heads=32)
    ref = ref_paged_attention(*batch.args())
    for cfg in (AttentionConfig(16, 16, 1, 4, 4, tma_paged=True), AttentionConfig(16, 16, 8, 4, 6, tma_paged=True),
                AttentionConfig(128, 64, 1, 8, 3, new_kv=True, prefetch_ids=True, tma_new_kv=True),
                AttentionConfig(128, 16, 1, 8, 3, new_kv=True, tma_new_kv=True, tma_paged=True)):
        out = triton_paged_attention(*batch.args(), config=cfg, key=key, value=value)
        assert_close_to_reference(out, ref, dtype)


def _huge_pool_blocks(num_kv_heads: int, head_size: int, block_size: int) -> int:
    per_block = block_size * num_kv_heads * head_size
    return (2**31 + per_block - 1) // per_block + 64  # element offsets of the last blocks exceed 2**31


def _need_free_bytes(nbytes: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes * 1.2:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB free GPU memory")


def test_attention_in_pool_beyond_int32_offsets():
    hkv, d, bs = 8, 128, 16
    first = _huge_pool_blocks(hkv, d, bs) - 40
    _need_free_bytes(2 * (first + 60) * bs * hkv * d * 2)
    seqs = [(300, 1), (0, 40), (100, 20)]  # 29 blocks, all above the 2**31-element mark
    batch = make_batch(seqs, num_heads=32, num_kv_heads=hkv, head_size=d, block_size=bs,
                       dtype=torch.float16, device="cuda", seed=13, first_block=first, spare_blocks=4)
    assert batch.key_cache.numel() > 2**31
    ref = ref_paged_attention(*batch.args())
    out = triton_paged_attention(*batch.args())
    assert_close_to_reference(out, ref, torch.float16)
    # cache blocks by TMA: the descriptors' byte addresses past 2**31 elements too
    out = triton_paged_attention(*batch.args(), config=AttentionConfig(16, 16, 1, 4, 4, tma_paged=True))
    assert_close_to_reference(out, ref, torch.float16)
    torch.cuda.synchronize()


def test_cache_write_in_pool_beyond_int32_offsets():
    hkv, d, bs = 8, 128, 16
    nblocks = _huge_pool_blocks(hkv, d, bs)
    _need_free_bytes(2 * nblocks * bs * hkv * d * 2)
    kc = torch.zeros((nblocks, bs, hkv, d), dtype=torch.float16, device="cuda")
    vc = torch.zeros_like(kc)
    n = 6
    key = torch.randn((n, hkv, d), device="cuda").half()
    value = torch.randn((n, hkv, d), device="cuda").half()
    top = nblocks * bs
    slots = torch.tensor([top - 1, -1, top - 17, 5, top - bs * 30, top - 2], dtype=torch.int64, device="cuda")
    triton_reshape_and_cache(key, value, kc, vc, slots)
    torch.cuda.synchronize()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // bs, s % bs], key[i]) and torch.equal(vc[s // bs, s % bs], value[i])
    del kc, vc


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cache_write_large_batch(dtype):
    n, hkv, d, bs, nb = 4096, 8, 128, 16, 512
    key = torch.randn((n, hkv, d), device="cuda").to(dtype)
    value = torch.randn((n, hkv, d), device="cuda").to(dtype)
    slots = torch.randperm(nb * bs, device="cuda")[:n]
    slots[::7] = -1
    kc = torch.zeros((nb, bs, hkv, d), dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    triton_reshape_and_cache(key, value, kc, vc, slots)
    ref_reshape_and_cache(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_step_varying_integers_compile_no_new_variant():
    """Batch size and block-table width change every replay step; once a configuration is
    compiled, a batch of 1, of 16, or a table 16 blocks wide must not compile another variant
    (a compilation inside a timed step would be measured as step time)."""
    from kernels.jit_stats import compiled_variant_count

    cfg = AttentionConfig(block_m=16, tile_n=64, num_segments=1, num_warps=8, num_stages=3)

    def run(seqs):
        batch = make_batch(seqs, num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                           dtype=torch.bfloat16, device="cuda", seed=len(seqs))
        out = triton_paged_attention(*batch.args(), config=cfg)
        assert_close_to_reference(out, ref_paged_attention(*batch.args()), torch.bfloat16)

    run([(40, 1), (70, 1), (5, 1)])  # 3 sequences, 5-block table: compiles the configuration
    before = compiled_variant_count()
    assert before is not None
    run([(40, 1)])  # one sequence
    run([(100, 1)] * 16)  # 16 sequences
    run([(16 * 16 - 1, 1), (3, 1)])  # a table exactly 16 blocks wide
    run([(15, 1)])  # a one-block table
    assert compiled_variant_count() == before
