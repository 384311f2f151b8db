"""Triton paged attention for a mixed prefill/decode batch (one unified kernel).

Work decomposition
------------------
Program ``(tile * num_kv_heads + kv_head, segment)`` handles ``BLOCK_Q`` consecutive new tokens of ONE sequence
times the ``QPK = num_heads // num_kv_heads`` query heads that share ``kv_head``: its
``BLOCK_M = BLOCK_Q * QPK`` (rounded up to a power of two) query rows all read the same K/V
tiles, so grouped-query attention costs one KV read per group.  Tiles are numbered per sequence
from ``query_start_loc[i] // BLOCK_Q + i``, which upper-bounds every sequence's tile count without a
host sync; a program finds its sequence with a binary search over ``query_start_loc`` and exits
if it lies past its sequence's last tile. A decode-only batch (one query token per sequence) is
launched with one tile per sequence and no search.

Each program walks the sequence's keys ``TILE_N`` at a time, translating key position ``j`` into
``block_tables[seq, j // BLOCK_SIZE]`` and slot ``j % BLOCK_SIZE`` (a scalar lookup per tile when
``TILE_N <= BLOCK_SIZE``), with an fp32 online softmax in base 2.  Only keys up to the tile's
causal horizon are visited; tiles entirely below the horizon of every row skip all masking.

For decode-heavy batches with few ``(sequence, kv_head)`` pairs the key range is further split
into ``NUM_SEGMENTS`` parts (flash-decoding): each writes an unnormalised partial result plus its
running max and sum to fp32 scratch, and ``_merge_segments_kernel`` combines them.

All pointer offsets are int64.  Masked loads never touch slots outside ``[0, seq_len)`` of the
sequence's own blocks, so stale or NaN data in the pool cannot leak into the output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .layout import MAX_BLOCK_SIZE, SUPPORTED_DTYPES, is_power_of_two, next_power_of_two

LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    tile,
    BLOCK_Q: tl.constexpr,
):
    """Largest i < num_seqs with query_start_loc[i] // BLOCK_Q + i <= tile (binary search)."""
    lo: tl.int32 = 0  # annotated: loop-carried int32 tensors even when num_seqs is a constexpr 1
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc, m_i, l_i,  # running state: [BLOCK_M, HEAD_PAD], [BLOCK_M], [BLOCK_M] fp32
    q,  # [BLOCK_M, HEAD_PAD] query rows (cast for the dot already)
    k_base, v_base,  # cache pointers advanced to this kv head
    bt_row_ptr,  # [max_blocks_per_seq] block table of this sequence
    t,  # key tile index
    seq_len, row_pos,  # scalar; [BLOCK_M] causal horizon of each row (last key it may see)
    qk_scale,  # softmax scale * log2(e)
    stride_c_blk, stride_c_slot,  # cache strides (same for K and V)
    offs_d,  # [HEAD_PAD]
    kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,  # the step's new K/V (CONTIG tiles only)
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row
    DOT_FP32: tl.constexpr, DOT_PREC: tl.constexpr,
    CONTIG: tl.constexpr = False,  # the tile's keys are all new tokens: read them from the step's K/V
    blk_ids=None,  # [TILE_N] int64 block of each key, loaded one tile ahead (PREFETCHED only)
    PREFETCHED: tl.constexpr = False,
):
    offs_n = tl.arange(0, TILE_N).to(tl.int64)
    key_pos = t * TILE_N + offs_n  # [TILE_N] int64 (t < 2**31 / TILE_N since seq_len is int32)
    if CONTIG:
        tok = tok0 + key_pos  # token index of each key in this step's batch
        k_ptrs = kn_base + tok[None, :] * stride_kn_tok + offs_d[:, None]  # [HEAD_PAD, TILE_N]
        v_ptrs = vn_base + tok[:, None] * stride_vn_tok + offs_d[None, :]  # [TILE_N, HEAD_PAD]
    elif PREFETCHED:
        slot_off = blk_ids * stride_c_blk + (key_pos % BLOCK_SIZE) * stride_c_slot
    elif TILE_N <= BLOCK_SIZE:
        # the whole tile sits inside one cache block: one scalar table lookup
        blk = tl.load(bt_row_ptr + (t * TILE_N) // BLOCK_SIZE).to(tl.int64)
        slot_off = blk * stride_c_blk + (key_pos % BLOCK_SIZE) * stride_c_slot  # [TILE_N]
    else:
        if MASKED:
            blk = tl.load(bt_row_ptr + key_pos // BLOCK_SIZE, mask=key_pos < seq_len, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row_ptr + key_pos // BLOCK_SIZE).to(tl.int64)
        slot_off = blk * stride_c_blk + (key_pos % BLOCK_SIZE) * stride_c_slot
    if not CONTIG:
        k_ptrs = k_base + slot_off[None, :] + offs_d[:, None]  # [HEAD_PAD, TILE_N]
        v_ptrs = v_base + slot_off[:, None] + offs_d[None, :]  # [TILE_N, HEAD_PAD]
    if MASKED:
        key_ok = key_pos < seq_len
        if HEAD_PAD != HEAD_SIZE:
            k = tl.load(k_ptrs, mask=key_ok[None, :] & (offs_d[:, None] < HEAD_SIZE), other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None] & (offs_d[None, :] < HEAD_SIZE), other=0.0)
        else:
            k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
    else:
        if HEAD_PAD != HEAD_SIZE:
            k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_SIZE, other=0.0)
            v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_SIZE, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, TILE_N] fp32, log2 domain
    if MASKED:
        visible = key_pos[None, :] <= row_pos[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _tile_block_ids(bt_row_ptr, t, seq_len, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """[TILE_N] int64: the cache block of each key of tile t (0 past the sequence's end)."""
    key_pos = t * TILE_N + tl.arange(0, TILE_N).to(tl.int64)
    return tl.load(bt_row_ptr + key_pos // BLOCK_SIZE, mask=key_pos < seq_len, other=0).to(tl.int64)


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, k_base, v_base, bt_row_ptr,
    t_begin, t_end,  # key tiles [t_begin, t_end), all read the same way
    seq_len, row_pos, qk_scale, stride_c_blk, stride_c_slot, offs_d,
    kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PREC: tl.constexpr, CONTIG: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
):
    if PREFETCH_IDS and not CONTIG:
        # The block ids of tile t + 1 are loaded while tile t is attended. A K/V address then
        # depends on a value carried from the previous iteration, not on a load of its own
        # iteration, and Triton's pipeliner keeps num_stages - 1 tiles of K/V in flight; with
        # the ids loaded in-iteration it keeps one (sm_90 PTX: cp.async.wait_group 2 instead of
        # 0 at 3 stages; tests/kernels/test_kernels_compile_sm90.py).
        next_ids = _tile_block_ids(bt_row_ptr, t_begin, seq_len, BLOCK_SIZE, TILE_N)
        for t in range(t_begin, t_end):
            ids = next_ids
            next_ids = _tile_block_ids(bt_row_ptr, t + 1, seq_len, BLOCK_SIZE, TILE_N)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, t, seq_len, row_pos, qk_scale,
                stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
                HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED, DOT_FP32, DOT_PREC, CONTIG, ids, True,
            )
    else:
        for t in range(t_begin, t_end):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, t, seq_len, row_pos, qk_scale,
                stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
                HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED, DOT_FP32, DOT_PREC, CONTIG,
            )
    return acc, m_i, l_i


# Integer arguments that change from step to step are not specialised: Triton would otherwise
# compile a new variant whenever one of them is 1 or a multiple of 16 (a replay would meet
# those mid-run and time a compilation as a step). Strides of the cache and query stay
# specialised: they are fixed per model and their divisibility enables vector loads.
@triton.jit(do_not_specialize=["num_seqs", "ml_plane", "stride_bt_seq", "decode_only"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size] (written when NUM_SEGMENTS == 1)
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_PAD] fp32 (NUM_SEGMENTS > 1)
    part_ml_ptr,  # [2, num_tokens, num_heads, NUM_SEGMENTS] fp32: running max (log2), sum
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    qk_scale,  # float: scale * log2(e)
    num_seqs, num_heads, num_kv_heads,
    ml_plane,  # num_tokens * num_heads * NUM_SEGMENTS (offset of the sums in part_ml)
    stride_q_tok, stride_q_head,
    stride_o_tok, stride_o_head,
    stride_c_blk, stride_c_slot, stride_c_head,  # shared by K and V caches (checked by the launcher)
    stride_bt_seq,
    k_new_ptr, v_new_ptr,  # [num_tokens, num_kv_heads, head_size]: this step's K/V (NEW_KV only)
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
    decode_only,  # 1: no sequence has more than one query token (grid: one tile per sequence)
    QPK: tl.constexpr,  # query heads per kv head
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PREC: tl.constexpr,
    NEW_KV: tl.constexpr = False,  # key tiles wholly among the new tokens are read from k_new/v_new
    PREFETCH_IDS: tl.constexpr = False,  # load each tile's block ids one tile ahead (see _attend_range)
):
    # axis 0 enumerates (query tile, kv head) with the kv head fastest, so all heads of the
    # heaviest tiles start together; axis 1 is the KV segment
    pid = tl.program_id(0)
    tile = pid // num_kv_heads
    kv_head = (pid % num_kv_heads).to(tl.int64)
    segment = tl.program_id(1)

    # A decode-only batch has one tile per sequence, in order: no search. A runtime flag, not a
    # constexpr, so that decode-only and mixed steps share compiled variants (a replay meets
    # both, and the warm-up compiles each configuration once).
    seq = tile
    if decode_only == 0:
        seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    n_q_tiles = tl.cdiv(q_len, BLOCK_Q)
    first_tile = q_start // BLOCK_Q + seq
    if decode_only != 0:
        first_tile = seq
    local = tile - first_tile
    if local >= n_q_tiles:
        return
    # causal work grows with the tile index: hand the last (longest) tiles to the first programs
    q_tile = n_q_tiles - 1 - local
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    tok_in_chunk = q_tile * BLOCK_Q + offs_m // QPK  # [BLOCK_M]
    head = kv_head * QPK + offs_m % QPK  # [BLOCK_M] int64
    row_ok = (offs_m < BLOCK_Q * QPK) & (tok_in_chunk < q_len)
    tok = (q_start + tok_in_chunk).to(tl.int64)
    row_pos = context_len + tok_in_chunk  # last key position each row may attend to

    q_ptrs = q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_SIZE), other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # keys this tile needs: [0, kv_end); tiles below `full` need no mask for any row
    last_tok = tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    kv_end = context_len + last_tok
    num_kv_tiles = tl.cdiv(kv_end, TILE_N)
    full = (context_len + q_tile * BLOCK_Q + 1) // TILE_N
    if NUM_SEGMENTS > 1:
        per_seg = tl.cdiv(num_kv_tiles, NUM_SEGMENTS)
        t_lo = segment * per_seg
        t_hi = tl.minimum(t_lo + per_seg, num_kv_tiles)
    else:
        t_lo = 0
        t_hi = num_kv_tiles
    t_mid = tl.maximum(tl.minimum(full, t_hi), t_lo)

    k_base = k_cache_ptr + kv_head * stride_c_head
    v_base = v_cache_ptr + kv_head * stride_c_head
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # NEW_KV: tiles from t_new on hold only this step's new tokens, which are also in k_new/v_new
    # in token order: read there, without the block table (tiles before stay on the cache)
    kn_base = k_new_ptr + kv_head * stride_kn_head
    vn_base = v_new_ptr + kv_head * stride_vn_head
    tok0 = q_start.to(tl.int64) - context_len  # batch token index of key position 0's successors
    if NEW_KV:
        t_new = tl.cdiv(context_len, TILE_N)
    else:
        t_new = t_hi
    # four key ranges, each with its own constexpr specialisation: unmasked then masked tiles,
    # each read through the block table and then (NEW_KV) from the step's K/V
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, t_lo, tl.minimum(t_mid, t_new), seq_len, row_pos, qk_scale,
        stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
        HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, False, DOT_FP32, DOT_PREC, False, PREFETCH_IDS,
    )
    if NEW_KV:
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, tl.maximum(t_lo, t_new), t_mid, seq_len, row_pos, qk_scale,
            stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
            HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, False, DOT_FP32, DOT_PREC, True, PREFETCH_IDS,
        )
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, t_mid, tl.maximum(t_mid, tl.minimum(t_hi, t_new)), seq_len,
        row_pos, qk_scale, stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
        HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, True, DOT_FP32, DOT_PREC, False, PREFETCH_IDS,
    )
    if NEW_KV:
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, tl.maximum(t_mid, t_new), t_hi, seq_len, row_pos, qk_scale,
            stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
            HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, True, DOT_FP32, DOT_PREC, True, PREFETCH_IDS,
        )

    if NUM_SEGMENTS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_SIZE))
    else:
        part_row = (tok * num_heads + head) * NUM_SEGMENTS + segment  # [BLOCK_M] int64
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_ml_ptr + ml_plane + part_row, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs", "ml_plane"])
def _merge_segments_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_PAD] fp32
    part_ml_ptr,  # [2, num_tokens, num_heads, NUM_SEGMENTS] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs, num_heads,
    ml_plane,  # num_tokens * num_heads * NUM_SEGMENTS
    stride_o_tok, stride_o_head,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return  # padding token past the last sequence: no partials were written
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    row = (tok * num_heads + head) * NUM_SEGMENTS + offs_s  # [NUM_SEGMENTS] int64
    m = tl.load(part_ml_ptr + row)
    l = tl.load(part_ml_ptr + ml_plane + row)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # empty segments: exp2(-inf) = 0
    total = tl.sum(l * w, 0)
    total = tl.where(total == 0.0, 1.0, total)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_PAD + offs_d[None, :])  # [NUM_SEGMENTS, HEAD_PAD]
    o = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_SIZE)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionConfig:
    """Tile choices of one launch (all powers of two)."""

    block_m: int  # query rows per program (BLOCK_Q tokens x QPK heads, padded)
    tile_n: int  # keys per inner iteration
    num_segments: int  # KV splits (1 = no split, no merge kernel)
    num_warps: int
    num_stages: int
    new_kv: bool = False  # read key tiles of new tokens from the step's K/V (pass key=, value=)
    prefetch_ids: bool = False  # load block ids a tile ahead, so K/V pipeline num_stages - 1 deep


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def choose_config(
    *,
    qpk: int,
    head_pad: int,
    elem_size: int,
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
) -> AttentionConfig:
    """Heuristic tile choice: small query tiles + KV splitting for decode, big tiles for prefill."""
    min_m = max(16, next_power_of_two(qpk))
    if max_query_len * qpk <= min_m:
        # decode (or tiny chunks): memory bound; split the keys until the GPU is full
        block_m = min_m
        tile_n = 64 if elem_size <= 2 else 32
        programs = num_seqs * num_kv_heads
        kv_tiles = max(1, math.ceil(max_seq_len / tile_n))
        segments = 1
        while segments < 64 and programs * segments < 4 * num_sms and kv_tiles >= 4 * segments * 2:
            segments *= 2
        # 4 warps / 2 stages: 0.276 ms against 0.344 ms with 8 warps / 3 stages on an H200 (8 x 32k
        # decodes, 16 segments; reports/gpu/2026-11-30_H200/summary.md, config sweep)
        return AttentionConfig(block_m, tile_n, segments, num_warps=4, num_stages=2)
    if max_query_len * qpk <= 64:
        return AttentionConfig(max(min_m, 64), 64 if elem_size <= 2 else 32, 1, num_warps=8, num_stages=3)
    if elem_size > 2 or head_pad > 128:
        # fp32 (exact-math path used by tests) or very wide heads: smaller tiles so nothing spills
        return AttentionConfig(max(min_m, 32), 16, 1, num_warps=8, num_stages=2)
    return AttentionConfig(max(min_m, 128), 64, 1, num_warps=8, num_stages=3)


def _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache/value_cache must both be [num_blocks, block_size, num_kv_heads, head_size], "
            f"got {tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        )
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"key_cache and value_cache strides differ: {key_cache.stride()} vs {value_cache.stride()}")
    _, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"cache head_size {cache_head_size} != query head_size {head_size}")
    if head_size < 16:
        raise ValueError(f"head_size must be >= 16, got {head_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if not is_power_of_two(block_size) or block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be a power of two <= {MAX_BLOCK_SIZE}, got {block_size}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} not supported (use one of {SUPPORTED_DTYPES})")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"cache dtypes {key_cache.dtype}/{value_cache.dtype} must equal query dtype {query.dtype}")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride {t.stride(-1)})")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be a contiguous 1-D tensor, got shape {tuple(seq_lens.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1 or not query_start_loc.is_contiguous():
        raise ValueError(f"query_start_loc must be contiguous [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks] with stride 1 rows, got {tuple(block_tables.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")


class PagedAttentionLaunch:
    """One step's attention, validated and configured once, launched for every layer.

    Every layer of a step attends with the same block tables, sequence lengths and query offsets,
    and its query and caches have the same shapes and strides; only the tensors differ. vLLM
    builds its attention metadata once per step for the same reason. Checking the arguments and
    choosing tiles costs about as much host time as the launch itself, so a forward plans the
    step at its first layer (``plan_paged_attention``) and later layers only compare shapes and
    strides with the plan and launch. The split-KV scratch is allocated once and reused layer
    after layer (stream order keeps them apart, also inside a CUDA graph).
    """

    def __init__(self, query, key_cache, block_tables, seq_lens, query_start_loc, scale: float,
                 config: AttentionConfig, decode_only: bool = False) -> None:
        num_tokens, num_heads, head_size = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        num_seqs = seq_lens.shape[0]
        self.config = config
        self.query_shape, self.query_stride, self.dtype = query.shape, query.stride(), query.dtype
        self.cache_shape, self.cache_stride, self.device = key_cache.shape, key_cache.stride(), query.device
        self.empty = num_tokens == 0 or num_seqs == 0
        qpk = num_heads // num_kv_heads
        head_pad = max(16, next_power_of_two(head_size))
        block_q = config.block_m // qpk
        segs = config.num_segments
        interp = _interpreting()
        if segs > 1 and not self.empty:
            self.part_acc = torch.empty((num_tokens, num_heads, segs, head_pad), dtype=torch.float32, device=query.device)
            self.part_ml = torch.empty((2, num_tokens, num_heads, segs), dtype=torch.float32, device=query.device)
        else:
            self.part_acc = self.part_ml = None
        self.decode_only = decode_only
        tiles = num_seqs if decode_only else num_tokens // block_q + num_seqs
        self.grid = (tiles * num_kv_heads, segs)
        self.merge_grid = (num_tokens, num_heads)
        self.metadata = (block_tables, seq_lens, query_start_loc, float(scale) * LOG2E, num_seqs, num_heads,
                         num_kv_heads, num_tokens * num_heads * segs)
        self.strides = (query.stride(0), query.stride(1))
        self.cache_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0))
        self.constexprs = dict(
            QPK=qpk, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, TILE_N=config.tile_n,
            BLOCK_Q=block_q, BLOCK_M=config.block_m, NUM_SEGMENTS=segs,
            DOT_FP32=query.dtype == torch.float32 or (interp and query.dtype == torch.bfloat16),
            DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
            NEW_KV=config.new_kv, PREFETCH_IDS=config.prefetch_ids, num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        self.merge_args = (query_start_loc, num_seqs, num_heads, num_tokens * num_heads * segs)
        self.merge_constexprs = dict(HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SEGMENTS=segs, num_warps=4)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
                 out: torch.Tensor | None = None, key: torch.Tensor | None = None,
                 value: torch.Tensor | None = None) -> torch.Tensor:
        if (query.shape != self.query_shape or query.stride() != self.query_stride or query.dtype != self.dtype
                or query.device != self.device or key_cache.shape != self.cache_shape
                or key_cache.stride() != self.cache_stride or value_cache.shape != self.cache_shape
                or value_cache.stride() != self.cache_stride or key_cache.dtype != self.dtype
                or value_cache.dtype != self.dtype or key_cache.device != self.device or value_cache.device != self.device):
            raise ValueError(
                f"this attention launch was planned for query {tuple(self.query_shape)} strides {self.query_stride} "
                f"{self.dtype} and caches {tuple(self.cache_shape)} strides {self.cache_stride}; got query "
                f"{tuple(query.shape)} strides {query.stride()} {query.dtype}, caches {tuple(key_cache.shape)} "
                f"strides {key_cache.stride()} / {value_cache.stride()}")
        if out is None:
            out = torch.empty_like(query)
        elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(-1) != 1:
            raise ValueError(f"out must match query's shape/dtype/device with stride-1 last dim, got {tuple(out.shape)} {out.dtype}")
        if self.empty:
            return out
        num_tokens, _, head_size = self.query_shape
        if self.config.new_kv:
            num_kv_heads = self.cache_shape[2]
            for name, t in (("key", key), ("value", value)):
                if t is None or t.shape != (num_tokens, num_kv_heads, head_size) or t.stride(-1) != 1 \
                        or t.dtype != query.dtype or t.device != query.device:
                    raise ValueError(f"config.new_kv needs {name} [num_tokens={num_tokens}, {num_kv_heads}, {head_size}] "
                                     f"of the query's dtype and device with a contiguous last dimension")
            k_new, v_new = key, value
        else:
            k_new = v_new = query  # unused
        part_acc = self.part_acc if self.part_acc is not None else out  # unused without a split
        part_ml = self.part_ml if self.part_ml is not None else out
        _paged_attention_kernel[self.grid](
            out, part_acc, part_ml, query, key_cache, value_cache, *self.metadata,
            *self.strides, out.stride(0), out.stride(1), *self.cache_strides,
            k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            int(self.decode_only), **self.constexprs,
        )
        if self.part_acc is not None:
            _merge_segments_kernel[self.merge_grid](
                out, part_acc, part_ml, *self.merge_args, out.stride(0), out.stride(1), **self.merge_constexprs,
            )
        return out


def plan_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         scale: float, *, max_query_len: int | None = None, max_seq_len: int | None = None,
                         config: AttentionConfig | None = None, num_segments: int | None = None) -> PagedAttentionLaunch:
    """Check the arguments (as ``triton_paged_attention`` takes them) and choose the tiles once;
    the returned launch runs any layer whose query and caches have these shapes and strides
    (see ``PagedAttentionLaunch``)."""
    _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    _, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    qpk = num_heads // num_kv_heads
    if query.shape[0] and num_seqs:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
    if config is None:
        config = choose_config(
            qpk=qpk, head_pad=max(16, next_power_of_two(head_size)), elem_size=query.element_size(),
            num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_query_len=max_query_len or 1,
            max_seq_len=max_seq_len or 1, num_sms=_num_sms(query.device),
        )
    if num_segments is not None:
        config = replace(config, num_segments=num_segments)
    if not (is_power_of_two(config.block_m) and is_power_of_two(config.tile_n) and is_power_of_two(config.num_segments)):
        raise ValueError(f"config sizes must be powers of two: {config}")
    if config.block_m < qpk or config.tile_n < 16 or config.block_m < 16:
        raise ValueError(f"config too small for qpk={qpk}: {config}")
    # no query longer than one token: one program row per sequence (a sequence without a token
    # exits at once; tokens past the batch, e.g. graph padding, are left unwritten as before)
    decode_only = bool(num_seqs) and max_query_len is not None and max_query_len <= 1
    return PagedAttentionLaunch(query, key_cache, block_tables, seq_lens, query_start_loc, scale, config,
                                decode_only)


def triton_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
    config: AttentionConfig | None = None,
    num_segments: int | None = None,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]: this step's new K (config.new_kv)
    value: torch.Tensor | None = None,  # the same for V
) -> torch.Tensor:
    """Launch the unified paged-attention kernel; semantics as ``ref_paged_attention``.

    ``max_query_len``/``max_seq_len`` steer the tile heuristic; pass them to avoid a
    device-to-host sync. ``max_query_len`` must not be below the longest query: 1 launches the
    decode-only grid (one program row per sequence, no search for a program's sequence).  ``config``/``num_segments`` override the heuristic (tests, benchmarks).
    Output rows of tokens past ``query_start_loc[-1]`` (batch padding) are left unwritten.
    One call plans and launches; a forward over many layers plans once (``plan_paged_attention``).
    """
    launch = plan_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                  max_query_len=max_query_len, max_seq_len=max_seq_len, config=config,
                                  num_segments=num_segments)
    return launch(query, key_cache, value_cache, out=out, key=key, value=value)
