"""Triton kernel: write new tokens' K and V into the paged cache (``reshape_and_cache``).

One program per (token, chunk of the flattened ``num_kv_heads * head_size`` row).  Slot -1 marks
a padding token; its program returns without touching memory.  All offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import SUPPORTED_DTYPES, next_power_of_two


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_tok, stride_k_head,  # key strides (elements); head_size stride is 1
    stride_v_tok, stride_v_head,  # value strides
    stride_kc_blk, stride_kc_slot, stride_kc_head,  # key_cache strides
    stride_vc_blk, stride_vc_slot, stride_vc_head,  # value_cache strides
    ROW: tl.constexpr,  # num_kv_heads * head_size
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens per block)
    BLOCK_E: tl.constexpr,  # elements of the row handled by one program (power of two)
):
    tok = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    e = chunk * BLOCK_E + tl.arange(0, BLOCK_E).to(tl.int64)
    mask = e < ROW
    head = e // HEAD_SIZE
    d = e % HEAD_SIZE
    k = tl.load(key_ptr + tok * stride_k_tok + head * stride_k_head + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + head * stride_v_head + d, mask=mask)
    kc = key_cache_ptr + blk * stride_kc_blk + off * stride_kc_slot + head * stride_kc_head + d
    vc = value_cache_ptr + blk * stride_vc_blk + off * stride_vc_slot + head * stride_vc_head + d
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _check_cache_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"key/value must be [num_tokens, num_kv_heads, head_size], got {tuple(key.shape)} / {tuple(value.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache/value_cache must both be [num_blocks, block_size, num_kv_heads, head_size], "
            f"got {tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        )
    n, hkv, d = key.shape
    if key_cache.shape[2] != hkv or key_cache.shape[3] != d:
        raise ValueError(f"cache heads/head_size {tuple(key_cache.shape[2:])} do not match key's {(hkv, d)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != n:
        raise ValueError(f"slot_mapping must be [num_tokens={n}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not supported")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride {t.stride(-1)})")
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache dtype {key_cache.dtype} != value_cache dtype {value_cache.dtype}")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")


def triton_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Launch the cache-write kernel (in place); see ``ref_reshape_and_cache`` for semantics."""
    _check_cache_args(key, value, key_cache, value_cache, slot_mapping)
    n, hkv, d = key.shape
    if n == 0:
        return
    row = hkv * d
    block_e = min(next_power_of_two(row), 2048)
    grid = (n, triton.cdiv(row, block_e))
    _reshape_and_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        ROW=row, HEAD_SIZE=d, BLOCK_SIZE=key_cache.shape[1], BLOCK_E=block_e,
        num_warps=4 if block_e >= 512 else 1,
    )
