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

import triton
import triton.language as tl

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
def _block_and_slot(key_pos, BLOCK_SIZE: tl.constexpr):
    """(index into the block table, slot within the block) of key positions, as int32. The
    positions are non-negative and below 2**31, so the division by the power-of-two block size
    is done unsigned: a shift and a mask. Signed, it needs a fix-up for negative values, which
    the compiler cannot rule out once a key loop starts at a runtime tile (split KV, masked
    ranges): about a hundred more integer instructions per tile in sm_90 code
    (`python tests/kernels/sm90_compile.py --loops`)."""
    kp = key_pos.to(tl.uint32)
    return (kp // BLOCK_SIZE).to(tl.int32), (kp % BLOCK_SIZE).to(tl.int32)


@triton.jit
def _cache_offset(blk, in_block, stride_c_blk, stride_c_slot):
    """int64 element offset of slot `in_block` of cache block `blk`. The block's base is the one
    product that needs 64 bits: block id and stride are non-negative 32-bit values, so it is
    formed as an unsigned 32 x 32 -> 64-bit multiply (a signed int64 product also multiplies
    the sign extensions). The offset within a block is below the block stride, an int32."""
    base = blk.to(tl.uint32).to(tl.uint64) * stride_c_blk.to(tl.uint32).to(tl.uint64)
    return base.to(tl.int64) + (in_block * stride_c_slot).to(tl.int64)


@triton.jit
def _load_kv_tile(
    k_base, v_base, bt_row_ptr, t, key_pos, seq_len, stride_c_blk, stride_c_slot, offs_d,
    kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, CONTIG: tl.constexpr, blk_ids, PREFETCHED: tl.constexpr,
):
    """Key tile t as [HEAD_PAD, TILE_N] and value tile as [TILE_N, HEAD_PAD], through the block
    table (or, CONTIG, from the step's K/V rows), 0 past the sequence and past HEAD_SIZE."""
    if CONTIG:
        tok = tok0 + key_pos  # token index of each key in this step's batch
        k_ptrs = kn_base + tok[None, :] * stride_kn_tok + offs_d[:, None]  # [HEAD_PAD, TILE_N]
        v_ptrs = vn_base + tok[:, None] * stride_vn_tok + offs_d[None, :]  # [TILE_N, HEAD_PAD]
    elif PREFETCHED:
        slot_off = _cache_offset(blk_ids, _block_and_slot(key_pos, BLOCK_SIZE)[1], stride_c_blk, stride_c_slot)
    elif TILE_N <= BLOCK_SIZE:
        # the whole tile sits inside one cache block: one scalar table lookup
        blk = tl.load(bt_row_ptr + (t * TILE_N) // BLOCK_SIZE)
        slot_off = _cache_offset(blk, _block_and_slot(key_pos, BLOCK_SIZE)[1], stride_c_blk, stride_c_slot)
    else:
        entry, in_block = _block_and_slot(key_pos, BLOCK_SIZE)
        if MASKED:
            blk = tl.load(bt_row_ptr + entry, mask=key_pos < seq_len, other=0)
        else:
            blk = tl.load(bt_row_ptr + entry)
        slot_off = _cache_offset(blk, in_block, stride_c_blk, stride_c_slot)
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
    return k, v


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
    blk_ids=None,  # [TILE_N] int64 block of each key (TMA_PAGED: the tile's block), loaded one tile ahead
    PREFETCHED: tl.constexpr = False,
    TMA: tl.constexpr = False,  # CONTIG tiles: kn_base / vn_base are tensor descriptors (TMA copies)
    TMA_PAGED: tl.constexpr = False,  # cache tiles: k_base / v_base are tensor descriptors (one block a tile)
):
    offs_n = tl.arange(0, TILE_N).to(tl.int64)
    key_pos = t * TILE_N + offs_n  # [TILE_N] int64 (t < 2**31 / TILE_N since seq_len is int32)
    if CONTIG and TMA:
        # kn_base / vn_base are tensor descriptors over the step's K/V rows of this kv head: one
        # bulk copy per tile (rows past the step's tokens and head columns past HEAD_SIZE read 0;
        # rows of later sequences are finite and masked like any key past the causal horizon)
        row0 = (tok0 + t * TILE_N).to(tl.int32)
        k = tl.trans(kn_base.load([row0, 0]))  # [HEAD_PAD, TILE_N]
        v = vn_base.load([row0, 0])  # [TILE_N, HEAD_PAD]
    elif TMA_PAGED and not CONTIG:
        # k_base / v_base are tensor descriptors over this kv head's cache rows (one row per slot):
        # a tile is one cache block (TILE_N == BLOCK_SIZE), one bulk copy each for K and V. Slots
        # past the sequence hold stale data: their scores are masked, their values zeroed.
        tl.static_assert(TILE_N == BLOCK_SIZE and PREFETCHED)
        row0 = (blk_ids * BLOCK_SIZE).to(tl.int32)  # blk_ids: this tile's block, loaded an iteration ahead
        k = tl.trans(k_base.load([row0, 0]))  # [HEAD_PAD, TILE_N]
        v = v_base.load([row0, 0])  # [TILE_N, HEAD_PAD]
        if MASKED:
            v = tl.where((key_pos < seq_len)[:, None], v, 0.0)
    else:
        k, v = _load_kv_tile(k_base, v_base, bt_row_ptr, t, key_pos, seq_len, stride_c_blk, stride_c_slot, offs_d,
                             kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                             TILE_N, MASKED, CONTIG, blk_ids, PREFETCHED)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    # Raw scores; the scale (positive, so it commutes with max) is applied to the row maxima and
    # inside one fused multiply-add per score below: no separate multiply pass over the tile.
    s = tl.dot(q, k, input_precision=DOT_PREC)  # [BLOCK_M, TILE_N] fp32
    if MASKED:
        visible = key_pos[None, :] <= row_pos[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # running max, log2 domain
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _tile_block_ids(bt_row_ptr, t, seq_len, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                    ONE_BLOCK: tl.constexpr = False):
    """[TILE_N] int64: the cache block of each key of tile t (0 past the sequence's end); with
    ONE_BLOCK (a tile is one block, TMA copies) the tile's block id as a scalar."""
    if ONE_BLOCK:
        ids = tl.load(bt_row_ptr + t, mask=t * TILE_N < seq_len, other=0)
    else:
        key_pos = t * TILE_N + tl.arange(0, TILE_N).to(tl.int64)
        ids = tl.load(bt_row_ptr + _block_and_slot(key_pos, BLOCK_SIZE)[0], mask=key_pos < seq_len, other=0).to(tl.int64)
    return ids


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, k_base, v_base, bt_row_ptr,
    t_begin, t_end,  # key tiles [t_begin, t_end), all read the same way
    seq_len, row_pos, qk_scale, stride_c_blk, stride_c_slot, offs_d,
    kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PREC: tl.constexpr, CONTIG: tl.constexpr,
    PREFETCH_IDS: tl.constexpr, TMA: tl.constexpr = False, TMA_PAGED: tl.constexpr = False,
):
    if (PREFETCH_IDS or TMA_PAGED) and not CONTIG:
        # The block ids of tile t + 1 are loaded while tile t is attended. A K/V address (or, with
        # TMA_PAGED, the copy's coordinate: one block a tile) then depends on a value carried from
        # the previous iteration, not on a load of its own iteration, and Triton's pipeliner keeps
        # num_stages - 1 tiles of K/V in flight; with the ids loaded in-iteration it keeps one
        # (sm_90 PTX: cp.async.wait_group 2 instead of 0 at 3 stages; three TMA buffers instead
        # of one at 4; tests/kernels/test_kernels_compile_sm90.py).
        next_ids = _tile_block_ids(bt_row_ptr, t_begin, seq_len, BLOCK_SIZE, TILE_N, TMA_PAGED)
        for t in range(t_begin, t_end):
            ids = next_ids
            next_ids = _tile_block_ids(bt_row_ptr, t + 1, seq_len, BLOCK_SIZE, TILE_N, TMA_PAGED)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, t, seq_len, row_pos, qk_scale,
                stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
                HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED, DOT_FP32, DOT_PREC, CONTIG, ids, True,
                TMA_PAGED=TMA_PAGED,
            )
    else:
        for t in range(t_begin, t_end):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, t, seq_len, row_pos, qk_scale,
                stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
                HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED, DOT_FP32, DOT_PREC, CONTIG, TMA=TMA,
            )
    return acc, m_i, l_i


@triton.jit
def _attend_span(
    acc, m_i, l_i, q, k_base, v_base, bt_row_ptr,
    t_begin, t_end,  # key tiles [t_begin, t_end), all masked or all unmasked
    t_new,  # NEW_KV: the first tile holding only this step's new tokens
    seq_len, row_pos, qk_scale, stride_c_blk, stride_c_slot, offs_d,
    kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PREC: tl.constexpr, NEW_KV: tl.constexpr,
    PREFETCH_IDS: tl.constexpr, TMA_NEW: tl.constexpr, TMA_PAGED: tl.constexpr,
):
    """A span of key tiles: those before `t_new` through the block table, with NEW_KV those from
    `t_new` on from the step's own K/V (without NEW_KV, `t_new` is past the span; with TMA_NEW,
    kn_base / vn_base are tensor descriptors of it)."""
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, t_begin, tl.maximum(t_begin, tl.minimum(t_end, t_new)),
        seq_len, row_pos, qk_scale, stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok,
        stride_vn_tok, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED, DOT_FP32, DOT_PREC, False, PREFETCH_IDS,
        TMA_PAGED=TMA_PAGED,
    )
    if NEW_KV:
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, tl.maximum(t_begin, t_new), t_end,
            seq_len, row_pos, qk_scale, stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok,
            stride_vn_tok, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED, DOT_FP32, DOT_PREC, True, PREFETCH_IDS,
            TMA_NEW,
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
    TMA_NEW: tl.constexpr = False,  # NEW_KV tiles by tensor-descriptor (TMA) copies (sm_90+; needs an allocator)
    TMA_PAGED: tl.constexpr = False,  # cache tiles by TMA copies, one block a tile (TILE_N == BLOCK_SIZE)
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
    if TMA_PAGED:
        # this kv head's slots as rows of [HEAD_SIZE] (blocks are contiguous runs of BLOCK_SIZE
        # slots: the launcher checks stride_c_blk == BLOCK_SIZE * stride_c_slot); the row bound
        # only has to cover every block a table names
        k_base = tl.make_tensor_descriptor(k_base, shape=[2147483647, HEAD_SIZE], strides=[stride_c_slot, 1],
                                           block_shape=[BLOCK_SIZE, HEAD_PAD])
        v_base = tl.make_tensor_descriptor(v_base, shape=[2147483647, HEAD_SIZE], strides=[stride_c_slot, 1],
                                           block_shape=[BLOCK_SIZE, HEAD_PAD])
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # NEW_KV: tiles from t_new on hold only this step's new tokens, which are also in k_new/v_new
    # in token order: read there, without the block table (tiles before stay on the cache)
    kn_base = k_new_ptr + kv_head * stride_kn_head
    vn_base = v_new_ptr + kv_head * stride_vn_head
    if NEW_KV and TMA_NEW:
        # this kv head's rows of the step's K/V as [tokens, HEAD_SIZE] tiles of [TILE_N, HEAD_PAD]
        n_tok = tl.load(query_start_loc_ptr + num_seqs)
        kn_base = tl.make_tensor_descriptor(kn_base, shape=[n_tok, HEAD_SIZE], strides=[stride_kn_tok, 1],
                                            block_shape=[TILE_N, HEAD_PAD])
        vn_base = tl.make_tensor_descriptor(vn_base, shape=[n_tok, HEAD_SIZE], strides=[stride_vn_tok, 1],
                                            block_shape=[TILE_N, HEAD_PAD])
    tok0 = q_start.to(tl.int64) - context_len  # batch token index of key position 0's successors
    if NEW_KV:
        t_new = tl.cdiv(context_len, TILE_N)
    else:
        t_new = t_hi
    # keys [t_lo, t_mid) need no mask, keys [t_mid, t_hi) do; each span is read through the
    # block table and then (NEW_KV) from the step's K/V
    acc, m_i, l_i = _attend_span(
        acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, t_lo, t_mid, t_new, seq_len, row_pos, qk_scale,
        stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
        HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, False, DOT_FP32, DOT_PREC, NEW_KV, PREFETCH_IDS, TMA_NEW, TMA_PAGED,
    )
    acc, m_i, l_i = _attend_span(
        acc, m_i, l_i, q, k_base, v_base, bt_row_ptr, t_mid, t_hi, t_new, seq_len, row_pos, qk_scale,
        stride_c_blk, stride_c_slot, offs_d, kn_base, vn_base, tok0, stride_kn_tok, stride_vn_tok,
        HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, True, DOT_FP32, DOT_PREC, NEW_KV, PREFETCH_IDS, TMA_NEW, TMA_PAGED,
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
