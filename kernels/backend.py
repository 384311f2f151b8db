"""Backend selection and the public entry points ``reshape_and_cache`` / ``paged_attention``.

``select_backend(device)`` answers ``"triton"`` when the compiled kernels can run there (a CUDA
device with Triton installed, or any device while ``TRITON_INTERPRET=1`` is set, which runs the
kernels on CPU tensors) and ``"torch"`` otherwise, in which case the pure-torch reference in
``kernels/reference.py`` does the work (slow, but exact fp32 math).
"""
from __future__ import annotations

import importlib.util
import os

import torch

from .reference import ref_paged_attention, ref_reshape_and_cache


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def select_backend(device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"`` for tensors living on ``device``."""
    if os.environ.get("SIMKV_KERNEL_BACKEND") in ("torch", "triton"):
        return os.environ["SIMKV_KERNEL_BACKEND"]
    device = torch.device(device)
    if not triton_available():
        return "torch"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "triton"
    if device.type == "cuda" and torch.cuda.is_available():
        return "triton"
    return "torch"


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, skipped
) -> None:
    """Write each token's K/V into its cache slot, in place (dispatches on ``select_backend``)."""
    if select_backend(key.device) == "triton":
        from .triton_cache import triton_reshape_and_cache

        triton_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        ref_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of a mixed prefill/decode batch; see ``ref_paged_attention``."""
    if select_backend(query.device) == "triton":
        from .triton_attention import triton_paged_attention

        return triton_paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, out=out,
        )
    return ref_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len, out=out,
    )
