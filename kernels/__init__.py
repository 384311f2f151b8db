"""Paged-KV-cache kernels for the simkv GPU backend (vLLM-style).

Public API (see docs/kernels.md):

* ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)`` - write new tokens'
  K/V (``[num_tokens, num_kv_heads, head_size]``) into the paged caches
  (``[num_blocks, block_size, num_kv_heads, head_size]``); ``slot_mapping`` int64, -1 = skip.
* ``paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
  *, max_query_len=None, max_seq_len=None, out=None)`` - causal attention of a mixed batch,
  reading K/V only through each sequence's block table; returns ``[num_tokens, num_heads, head_size]``.
* ``ref_reshape_and_cache`` / ``ref_paged_attention`` - pure-torch fp32 references, same signatures.
* ``select_backend(device)`` - ``"triton"`` or ``"torch"``.

Also, imported from their modules: ``triton_attention.plan_paged_attention`` and
``triton_cache.plan_reshape_and_cache`` (checked and configured once per step, launched per
layer); ``layer_ops.layer_ops(backend)``, the set of kernels a forward calls, with the fused
element-wise kernels of ``triton_layer_ops`` (RMSNorm with the residual add, rotary, SiLU-and-mul)
and their torch references.

Triton is imported lazily, so this package works (with the torch backend) where Triton is absent.
"""
from .backend import paged_attention, reshape_and_cache, select_backend, triton_available
from .layout import allocate_kv_cache, kv_cache_shape
from .reference import ref_paged_attention, ref_reshape_and_cache

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "ref_reshape_and_cache",
    "ref_paged_attention",
    "select_backend",
    "triton_available",
    "allocate_kv_cache",
    "kv_cache_shape",
]
