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


def _write_signature(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor) -> tuple:
    """What a planned KV write is checked against at each layer: shapes, strides and dtypes."""
    return key.shape, key.stride(), value.stride(), key.dtype, key_cache.shape, key_cache.stride(), key_cache.dtype


class CacheWriteLaunch:
    """One step's KV write, checked once and launched for every layer (as ``PagedAttentionLaunch``):
    every layer writes the same slots from K/V views of the same shape and strides."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        n, hkv, d = key.shape
        self.signature = _write_signature(key, value, key_cache)
        row = hkv * d
        block_e = min(next_power_of_two(row), 2048)
        self.grid = (n, triton.cdiv(row, block_e))
        self.slot_mapping = slot_mapping
        self.strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
        self.constexprs = dict(ROW=row, HEAD_SIZE=d, BLOCK_SIZE=key_cache.shape[1], BLOCK_E=block_e,
                               num_warps=4 if block_e >= 512 else 1)

    def __call__(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        got = _write_signature(key, value, key_cache)
        if (got != self.signature or value.shape != key.shape or value.dtype != key.dtype
                or value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride()
                or value_cache.dtype != key_cache.dtype):
            raise ValueError(f"this KV write was planned for key/value/cache shapes, strides and dtypes {self.signature}, "
                             f"got {got} (value {tuple(value.shape)} {value.stride()}, value_cache {value_cache.stride()})")
        if self.grid[0] == 0:
            return
        _reshape_and_cache_kernel[self.grid](
            key, value, key_cache, value_cache, self.slot_mapping,
            *self.strides, *self.strides[4:],  # value_cache has key_cache's strides (checked above)
            **self.constexprs,
        )


def plan_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> CacheWriteLaunch:
    """Check the arguments once; the launch writes any layer's K/V of these shapes and strides."""
    _check_cache_args(key, value, key_cache, value_cache, slot_mapping)
    return CacheWriteLaunch(key, value, key_cache, slot_mapping)


def triton_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Launch the cache-write kernel (in place); see ``ref_reshape_and_cache`` for semantics."""
    plan_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)(key, value, key_cache, value_cache)
