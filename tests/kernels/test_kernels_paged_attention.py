"""Paged attention: Triton kernel vs the fp32 torch reference on small mixed batches.

Every batch lives in a shuffled, NaN-filled pool (see ``kernel_cases.make_batch``): the
reference never sees a NaN, so a NaN in the kernel output proves it read outside a sequence's
blocks.  CPU cases run under the Triton interpreter (fp32/fp16, plus bf16 with the dots
upcast to fp32); the CUDA cases repeat them compiled.
"""
from dataclasses import replace

import pytest
import torch
from kernel_cases import assert_close_to_reference, device_params, make_batch, new_kv_of

from kernels import ref_paged_attention
from kernels.triton_attention import AttentionConfig, triton_paged_attention


def scenarios(bs: int) -> dict[str, list[tuple[int, int]]]:
    """(cached context, new tokens) per sequence, for cache block size ``bs``."""
    return {
        "single_token": [(0, 1)],  # a sequence of length 1
        "one_block": [(bs - 1, 1), (0, bs)],  # exactly one block: decode / prefill
        "past_boundary": [(bs, 1), (0, bs + 1), (bs + 1, 2)],  # one token past a block boundary
        "mixed": [(0, 5), (2 * bs + 3, 1), (bs - 2, 6)],  # prefill + decode + chunked prefill
    }


def _check(batch, dtype, **kwargs):
    ref = ref_paged_attention(*batch.args())
    out = triton_paged_attention(*batch.args(), max_query_len=batch.max_query_len,
                                 max_seq_len=batch.max_seq_len, **kwargs)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert_close_to_reference(out, ref, dtype)
    return out


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qpk", [1, 4, 8])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (80, 32)])
@pytest.mark.parametrize("scenario", ["single_token", "one_block", "past_boundary", "mixed"])
def test_paged_attention_matches_reference(device, dtype, qpk, head_size, block_size, scenario):
    num_kv_heads = 2 if qpk == 1 else 1
    batch = make_batch(scenarios(block_size)[scenario], num_heads=num_kv_heads * qpk, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, dtype=dtype, device=device)
    _check(batch, dtype)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("head_size", [96, 128])
def test_paged_attention_other_head_sizes(device, head_size):
    batch = make_batch([(20, 1), (3, 9)], num_heads=4, num_kv_heads=2, head_size=head_size, block_size=16,
                       dtype=torch.float16, device=device, seed=1)
    _check(batch, torch.float16)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("block_size,tile_n", [(8, 16), (16, 64), (32, 16), (64, 32), (128, 16)])
def test_paged_attention_tile_vs_block_size(device, block_size, tile_n):
    """Tiles spanning several cache blocks (per-key table lookup) and tiles inside one block."""
    batch = make_batch([(block_size + 5, 1), (3, 4)], num_heads=4, num_kv_heads=1, head_size=64,
                       block_size=block_size, dtype=torch.float16, device=device, seed=2)
    cfg = AttentionConfig(block_m=16, tile_n=tile_n, num_segments=1, num_warps=4, num_stages=2)
    _check(batch, torch.float16, config=cfg)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("num_segments", [2, 4])
@pytest.mark.parametrize("seqs", [[(40, 1), (5, 1), (0, 1)], [(30, 3), (0, 6)]], ids=["decode", "mixed"])
def test_paged_attention_split_kv(device, num_segments, seqs):
    """Flash-decoding split of the key range (some segments empty) merges to the same result."""
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.float32, device=device, seed=3)
    cfg = AttentionConfig(block_m=16, tile_n=16, num_segments=num_segments, num_warps=4, num_stages=2)
    _check(batch, torch.float32, config=cfg)


@pytest.mark.parametrize("device", device_params())
def test_paged_attention_multi_token_query_tiles(device):
    """A long chunk spans several query tiles; causal masking differs per tile."""
    batch = make_batch([(7, 37), (0, 20)], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                       dtype=torch.float16, device=device, seed=4)
    cfg = AttentionConfig(block_m=16, tile_n=16, num_segments=1, num_warps=4, num_stages=2)  # BLOCK_Q = 8
    _check(batch, torch.float16, config=cfg)


@pytest.mark.parametrize("device", device_params())
def test_paged_attention_non_power_of_two_group(device):
    """3 query heads per KV head: query rows are padded to a power of two and masked."""
    batch = make_batch([(9, 2), (0, 3)], num_heads=6, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.float16, device=device, seed=5)
    _check(batch, torch.float16)


@pytest.mark.parametrize("device", device_params())
def test_paged_attention_bf16(device):
    """bf16 (on CPU the interpreter's bf16 dot is wrong, so the launcher upcasts the dots)."""
    batch = make_batch([(17, 1), (0, 5)], num_heads=4, num_kv_heads=1, head_size=80, block_size=16,
                       dtype=torch.bfloat16, device=device, seed=6)
    _check(batch, torch.bfloat16)


@pytest.mark.parametrize("device", device_params())
def test_paged_attention_out_argument_strided_query_and_padding(device):
    """``out=`` is filled in place; query may be a strided view; padding tokens are ignored."""
    batch = make_batch([(4, 3), (16, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.float16, device=device, seed=7)
    n, h, d = batch.query.shape
    fused = torch.zeros((n + 2, 2 * h, d), dtype=torch.float16, device=device)  # 2 padding tokens
    fused[:n, :h] = batch.query
    query = fused[:, :h]
    out = torch.full((n + 2, h, d), 7.0, dtype=torch.float16, device=device)
    res = triton_paged_attention(query, *batch.args()[1:], out=out)
    assert res is out
    ref = ref_paged_attention(*batch.args())
    assert_close_to_reference(out[:n], ref, torch.float16)
    assert (out[n:] == 7.0).all(), "rows of padding tokens must not be written"


@pytest.mark.parametrize("device", device_params())
def test_paged_attention_empty_query(device):
    batch = make_batch([(3, 1)], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                       dtype=torch.float16, device=device)
    q = batch.query[:0]
    qsl = torch.zeros(2, dtype=torch.int32, device=device)
    out = triton_paged_attention(q, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, qsl,
                                 batch.scale, max_query_len=0, max_seq_len=3)
    assert out.shape == (0, 2, 64)


def test_paged_attention_rejects_bad_arguments():
    batch = make_batch([(3, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.float16, device="cpu")
    q, kc, vc, bt, sl, qsl, scale = batch.args()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        triton_paged_attention(q[:, :3], kc, vc, bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="must equal query dtype"):
        triton_paged_attention(q.float(), kc, vc, bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="query_start_loc"):
        triton_paged_attention(q, kc, vc, bt, sl, qsl[:1], scale)
    with pytest.raises(ValueError, match="int32"):
        triton_paged_attention(q, kc, vc, bt.float(), sl, qsl, scale)
    with pytest.raises(ValueError, match="head_size"):
        triton_paged_attention(q[..., :32], kc, vc, bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="block_size"):
        triton_paged_attention(q, kc[:, :12], vc[:, :12], bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        triton_paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="powers of two"):
        triton_paged_attention(q, kc, vc, bt, sl, qsl, scale,
                               config=AttentionConfig(block_m=24, tile_n=16, num_segments=1, num_warps=4, num_stages=2))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype,tile_n", [(torch.float32, 16), (torch.float16, 32)])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_paged_attention_new_kv_tiles_match_reference(device, dtype, tile_n, tma):
    """config.new_kv: key tiles lying wholly among the new tokens come from the step's K/V (here
    strided views of a fused tensor); tiles with cached keys, and the one crossing into the new
    tokens, from the cache. Fresh prefills, chunks after a context, and decodes together. With
    tma_new_kv those tiles are tensor-descriptor copies (rows past a sequence are later
    sequences' keys or, past the last token, zeros: all masked)."""
    seqs = [(0, 33), (23, 17), (32, 16), (50, 1), (7, 9)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
                       device=device, seed=tile_n)
    key, value = new_kv_of(batch, seqs, fused_heads=8)
    for block_m, segments in ((64, 1), (16, 2)):
        cfg = AttentionConfig(block_m=block_m, tile_n=tile_n, num_segments=segments, num_warps=4, num_stages=2,
                              new_kv=True, tma_new_kv=tma)
        out = triton_paged_attention(*batch.args(), config=cfg, key=key, value=value)
        assert_close_to_reference(out, ref_paged_attention(*batch.args()), dtype)


@pytest.mark.parametrize("device", device_params())
def test_paged_attention_new_kv_fresh_prefill_never_reads_the_cache(device):
    """A fresh prefill (no cached context) has every key tile among its new tokens: with new_kv
    the cache is not read at all, so poisoning it with NaN changes nothing."""
    seqs = [(0, 37), (0, 64)]
    batch = make_batch(seqs, num_heads=4, num_kv_heads=1, head_size=64, block_size=16, dtype=torch.float16,
                       device=device, seed=3)
    key, value = new_kv_of(batch, seqs)
    ref = ref_paged_attention(*batch.args())
    batch.key_cache.fill_(float("nan"))
    batch.value_cache.fill_(float("nan"))
    cfg = AttentionConfig(block_m=64, tile_n=32, num_segments=1, num_warps=4, num_stages=2, new_kv=True)
    for config in (cfg, replace(cfg, tma_new_kv=True)):
        out = triton_paged_attention(*batch.args(), config=config, key=key, value=value)
        assert_close_to_reference(out, ref, torch.float16)
    with pytest.raises(ValueError, match="new_kv needs key"):
        triton_paged_attention(*batch.args(), config=cfg)
    with pytest.raises(ValueError, match="tma_new_kv reads the new_kv tiles"):
        triton_paged_attention(*batch.args(), config=replace(cfg, new_kv=False, tma_new_kv=True))
    shifted = torch.zeros((key.shape[0], 1, 66), dtype=key.dtype, device=key.device)[:, :, 1:65]  # 2 bytes off
    shifted.copy_(key)
    with pytest.raises(ValueError, match="tma_new_kv needs key rows aligned to 16 bytes"):
        triton_paged_attention(*batch.args(), config=replace(cfg, tma_new_kv=True), key=shifted, value=value)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype,block_size,head_size", [(torch.float32, 16, 64), (torch.float16, 32, 80)])
def test_paged_attention_tma_paged_cache_tiles(device, dtype, block_size, head_size):
    """config.tma_paged: each cache tile is one block copied by TMA (tile_n == block_size), its
    id loaded an iteration ahead. Stale slots past a sequence (NaN here) are masked and their
    values zeroed; head columns past head_size read as zeros. Decodes, chunks after a context,
    split and unsplit key ranges, with and without new_kv."""
    seqs = [(0, 33), (23, 17), (2 * block_size, 16), (50, 1), (7, 9), (3 * block_size + 1, 1)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_size=head_size, block_size=block_size, dtype=dtype,
                       device=device, seed=block_size)
    ref = ref_paged_attention(*batch.args())
    key, value = new_kv_of(batch, seqs, fused_heads=8)
    for block_m, segments, new_kv in ((16, 1, False), (16, 4, False), (64, 1, True)):
        cfg = AttentionConfig(block_m=block_m, tile_n=block_size, num_segments=segments, num_warps=4, num_stages=3,
                              new_kv=new_kv, tma_new_kv=new_kv, tma_paged=True)
        out = triton_paged_attention(*batch.args(), config=cfg, key=key, value=value)
        assert_close_to_reference(out, ref, dtype)
    with pytest.raises(ValueError, match="tma_paged: a tile must be one cache block"):
        triton_paged_attention(*batch.args(), config=replace(cfg, tile_n=2 * block_size, new_kv=False, tma_new_kv=False))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("block_size,tile_n", [(16, 16), (8, 32), (32, 16)])
@pytest.mark.parametrize("new_kv", [False, True])
def test_paged_attention_prefetched_block_ids(device, block_size, tile_n, new_kv):
    """config.prefetch_ids: each tile's block ids are loaded while the previous tile is attended
    (the load for the tile past a range's end is masked to the sequence). Decodes, a long chunk
    over several query tiles, a chunk after a context, split and unsplit key ranges."""
    seqs = [(0, 37), (2 * block_size + 3, 1), (tile_n + 5, 9), (3 * tile_n, 1)]
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_size=64, block_size=block_size,
                       dtype=torch.float32, device=device, seed=block_size + tile_n)
    ref = ref_paged_attention(*batch.args())
    kv = dict(zip(("key", "value"), new_kv_of(batch, seqs))) if new_kv else {}
    for block_m, segments in ((16, 1), (16, 4), (32, 1)):
        cfg = AttentionConfig(block_m=block_m, tile_n=tile_n, num_segments=segments, num_warps=4, num_stages=2,
                              new_kv=new_kv, prefetch_ids=True)
        out = triton_paged_attention(*batch.args(), config=cfg, **kv)
        assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("num_segments", [1, 4])
def test_paged_attention_decode_only_grid(device, num_segments):
    """A batch with no query longer than one token runs one program row per sequence without
    searching for it: same output as the reference, including a sequence with no query token
    and padding tokens past the batch (left unwritten)."""
    from kernels.triton_attention import plan_paged_attention

    seqs = [(40, 1), (9, 0), (0, 1), (17, 1), (33, 1)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.float16, device=device, seed=11)
    n, h, d = batch.query.shape
    query = torch.cat([batch.query, torch.randn((3, h, d), device=device).to(torch.float16)])  # 3 pad tokens
    args = (query, *batch.args()[1:])
    for hint in (1, None):
        launch = plan_paged_attention(*args, max_query_len=hint, max_seq_len=batch.max_seq_len,
                                      num_segments=num_segments)
        assert launch.decode_only and launch.grid[0] == len(seqs) * 2
        out = torch.full_like(query, 7.0)
        launch(query, batch.key_cache, batch.value_cache, out=out)
        assert_close_to_reference(out[:n], ref_paged_attention(*batch.args()), torch.float16)
        assert (out[n:] == 7.0).all()
    mixed = make_batch([(4, 3), (16, 1)], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.float16, device=device)
    assert not plan_paged_attention(*mixed.args(), max_query_len=3).decode_only
    assert not plan_paged_attention(*mixed.args()).decode_only
