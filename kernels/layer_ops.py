"""The element-wise work of a decoder layer: RMSNorm (with the residual add fused in), rotary
embedding, SiLU-and-multiply. Torch references here; fused Triton kernels in
``kernels/triton_layer_ops.py``.

Why fused kernels: written with torch operators, a Llama layer issues about thirty kernels
besides its four matmuls and attention (an RMSNorm alone is seven: cast, square, mean, add,
rsqrt, multiply, cast-and-scale), each a pass over the activations and a launch from the host.
vLLM runs one custom kernel for each of these operations (``fused_add_rms_norm``,
``rotary_embedding``, ``silu_and_mul``); with them a layer is ten launches. The references
define the semantics; both implementations compute in fp32 and round to the activations'
dtype where the torch code rounds (the residual sum, the normalised row, the rotated q/k,
the activation).

Each operation takes the same arguments in both implementations:

* ``rms_norm(x, weight, eps)`` -> ``weight * (x / rms(x))``, ``x`` of shape ``[T, H]``.
* ``fused_add_rms_norm(x, residual, weight, eps)`` -> ``(rms_norm(x + residual), x + residual)``;
  the sum is written into ``residual`` (both versions, as in vLLM) and the Triton version
  writes the normalised rows into ``x`` (``x`` is consumed).
* ``rotary_embedding(qkv, cos, sin, num_rotated_heads)`` rotates the first ``num_rotated_heads``
  heads of ``qkv [T, heads, head_size]`` in place (neox style, ``x * cos + rotate_half(x) * sin``)
  and returns nothing; ``cos``/``sin`` are ``[T, head_size]`` tables of each token's position
  (both halves equal). The torch version computes out of place and copies back
  (one more pass than the fused kernel).
* ``silu_and_mul(gate_up)`` -> ``silu(gate) * up`` for ``gate_up = [gate | up]`` of shape ``[T, 2 I]``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .reference import ref_paged_attention, ref_reshape_and_cache


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def ref_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual.add_(x)  # in place, as the fused kernel
    return ref_rms_norm(residual, weight, eps), residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_rotary_embedding(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_rotated_heads: int) -> None:
    x = qkv[:, :num_rotated_heads]
    x.copy_(x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :])  # in place, as the fused kernel


def ref_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def ref_plan_write_cache(key, value, key_cache, value_cache, slot_mapping) -> Callable:
    """The reference has nothing to plan: bind the step's slots, write each layer."""
    def write(k, v, kc, vc) -> None:
        ref_reshape_and_cache(k, v, kc, vc, slot_mapping)
    return write


def ref_plan_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                       max_query_len=None, max_seq_len=None) -> Callable:
    """The reference has nothing to plan: bind the step's metadata, attend for each layer."""
    def attend(q, kc, vc, out=None, key=None, value=None):  # key/value: the step's K/V, already in the cache
        return ref_paged_attention(q, kc, vc, block_tables, seq_lens, query_start_loc, scale,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len, out=out)
    return attend


@dataclass(frozen=True)
class LayerOps:
    """The kernels one forward pass calls, as a set: torch operators or fused Triton kernels for
    the element-wise work, and the paged KV write and attention of ``kernels/``.

    The KV write and attention are planned once per step: ``plan_write_cache(k, v, key_cache,
    value_cache, slot_mapping)`` and ``plan_attention(q, key_cache, value_cache, block_tables,
    seq_lens, query_start_loc, scale, max_query_len=, max_seq_len=)`` check the first layer's
    arguments and return a launch that every layer calls with its own ``(k, v, key_cache,
    value_cache)`` or ``(q, key_cache, value_cache, out=, key=k, value=v)`` (the step's own K/V,
    which a tuned prefill launch may read instead of the cache)."""

    name: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    plan_write_cache: Callable
    plan_attention: Callable


def layer_ops(kernel_backend: str, fused: bool | None = None, tuning=None) -> LayerOps:
    """The op set for a kernel backend (``"torch"`` or ``"triton"``). ``fused`` picks the
    element-wise kernels: the Triton ones by default with the Triton backend, the torch
    operators otherwise (``fused=False`` with Triton attention measures what fusing saves).
    ``tuning`` (a ``kernels.tuning.KernelTuning``) steers the Triton attention's tiles; the
    op set's name then carries its fingerprint, so runs on other tiles are told apart."""
    tiles = ""
    if kernel_backend == "torch":
        plans = (ref_plan_write_cache, ref_plan_attention)
    elif kernel_backend == "triton":
        from .triton_attention import plan_paged_attention
        from .triton_cache import plan_reshape_and_cache

        plans = (plan_reshape_and_cache, plan_paged_attention)
        if tuning is not None:
            plans = (plan_reshape_and_cache, functools.partial(plan_paged_attention, tuning=tuning))
            tiles = f" ({tuning.label})"
    else:
        raise ValueError(f"unknown kernel backend '{kernel_backend}' (torch or triton)")
    if fused is None:
        fused = kernel_backend == "triton"
    if fused:
        from .triton_layer_ops import (triton_fused_add_rms_norm, triton_rms_norm, triton_rotary_embedding,
                                       triton_silu_and_mul)

        elementwise = (triton_rms_norm, triton_fused_add_rms_norm, triton_rotary_embedding, triton_silu_and_mul)
    else:
        elementwise = (ref_rms_norm, ref_fused_add_rms_norm, ref_rotary_embedding, ref_silu_and_mul)
    name = f"{kernel_backend} attention{tiles}, {'fused Triton' if fused else 'torch'} element-wise ops"
    return LayerOps(name, *elementwise, *plans)
