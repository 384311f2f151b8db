"""Pure-torch reference kernels (fp32 math).

They define the semantics every Triton kernel is tested against, and they are the slow
fallback backend on machines without Triton.  Signatures match ``kernels.reshape_and_cache``
and ``kernels.paged_attention`` exactly; see ``kernels/layout.py`` for the cache layout.
"""
from __future__ import annotations

import torch


def ref_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, skipped
) -> None:
    """Write token ``i``'s K/V into flat slot ``slot_mapping[i]`` of the caches (in place)."""
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


def _gather_context(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_size] tokens of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = table_row[:num_blocks].to(torch.int64)
    flat = cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])
    return flat[:seq_len]


def ref_paged_attention(
    query: torch.Tensor,  # [num_query_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached context + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query-token offsets
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [num_query_tokens, num_heads, head_size]
) -> torch.Tensor:
    """Attention of each sequence's new query tokens over its whole (cached + new) context.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` (its ``q_len``
    newest tokens) and has ``seq_lens[i]`` tokens in the cache, the newest ``q_len`` of which
    are the new ones (already written by ``reshape_and_cache``).  Query token ``r`` of the
    chunk sits at position ``seq_len - q_len + r`` and attends to positions ``0..that``
    (causal within the chunk, full over the cached context).  Query heads are grouped onto
    KV heads: head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    ``max_query_len``/``max_seq_len`` are accepted for signature compatibility and ignored.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    result = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float32, device=query.device)
    for i, seq_len in enumerate(lens):
        q0, q1 = qsl[i], qsl[i + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if seq_len < q_len:
            raise ValueError(f"sequence {i}: seq_len={seq_len} < query length {q_len}")
        k = _gather_context(key_cache, block_tables[i], seq_len).float()  # [S, Hkv, D]
        v = _gather_context(value_cache, block_tables[i], seq_len).float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q0:q1].float().transpose(0, 1)  # [H, Q, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, Q, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [Q, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result[q0:q1] = torch.matmul(probs, v).transpose(0, 1)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out
