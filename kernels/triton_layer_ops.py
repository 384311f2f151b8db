"""Triton kernels for a decoder layer's element-wise work: RMSNorm (optionally fused with the
residual add), rotary embedding in place, SiLU-and-multiply. Semantics: ``kernels/layer_ops.py``.

Each kernel makes one pass over its rows and computes in fp32. None takes the number of rows
as an argument (the grid carries it), so a new batch size never compiles a new variant in the
middle of a timed step. All row offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import SUPPORTED_DTYPES, next_power_of_two


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,  # rows of [T, HIDDEN]
    stride_x, stride_r, stride_o, stride_ro,  # row strides (elements); columns are contiguous
    eps,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= HIDDEN
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # rounded to the activations' dtype, as the stored residual is and as torch's add is
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr,  # [T, 2 * INTER], [T, INTER]
    stride_gu, stride_o,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    g = tl.load(gate_up_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_gu + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    qkv_ptr,  # [T, heads, HEAD_SIZE]; the first NUM_ROTATED heads are rotated in place
    cos_ptr, sin_ptr,  # [T, HEAD_SIZE] (both halves equal; the first is read)
    stride_tok, stride_head, stride_cos, stride_sin,
    NUM_ROTATED: tl.constexpr,
    HALF: tl.constexpr,  # HEAD_SIZE // 2
    HALF_PAD: tl.constexpr,  # next power of two >= HALF
    HEADS_PER_PROGRAM: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    j = tl.arange(0, HALF_PAD)
    jmask = j < HALF
    c = tl.load(cos_ptr + tok * stride_cos + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + tok * stride_sin + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
    mask = (heads < NUM_ROTATED)[:, None] & jmask[None, :]
    first = qkv_ptr + tok * stride_tok + heads.to(tl.int64)[:, None] * stride_head + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    tl.store(first, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


def _check_rows(name: str, t: torch.Tensor, width: int | None = None) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [num_tokens, width], got shape {tuple(t.shape)}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name} has {t.shape[1]} columns, expected {width}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype {t.dtype} not supported")
    if t.shape[0] and t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (column stride {t.stride(1)})")


def _norm_warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 1


def _rms_norm(x, residual, weight, eps, out, residual_out) -> None:
    """Check the arguments of either norm, then launch it (nothing to launch for no rows)."""
    _check_rows("x", x)
    has_res = residual is not None
    if has_res:
        _check_rows("residual", residual, x.shape[1])
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if not x.shape[0]:
        return
    hidden = x.shape[1]
    block = next_power_of_two(hidden)
    _rms_norm_kernel[(x.shape[0],)](
        x, residual if has_res else x, weight.contiguous(), out, residual_out if has_res else out,
        x.stride(0), residual.stride(0) if has_res else 0, out.stride(0),
        residual_out.stride(0) if has_res else 0, float(eps),
        HIDDEN=hidden, BLOCK_H=block, HAS_RESIDUAL=has_res, num_warps=_norm_warps(block),
    )


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` per row of ``x [T, H]`` (new tensor)."""
    out = torch.empty_like(x)
    _rms_norm(x, None, weight, eps, out, None)
    return out


def triton_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, written into ``x`` and ``residual`` (consumed)."""
    _rms_norm(x, residual, weight, eps, x, residual)
    return x, residual


def triton_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]``, shape ``[T, 2 I]`` -> ``[T, I]`` (new tensor)."""
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even number of columns, got {gate_up.shape[1]}")
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        block = min(next_power_of_two(inter), 1024)
        _silu_and_mul_kernel[(gate_up.shape[0], triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block,
            num_warps=4 if block >= 512 else 1,
        )
    return out


def triton_rotary_embedding(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_rotated_heads: int) -> None:
    """Rotate the first ``num_rotated_heads`` heads of ``qkv [T, heads, d]`` in place (neox style)."""
    if qkv.dim() != 3:
        raise ValueError(f"qkv must be [num_tokens, heads, head_size], got shape {tuple(qkv.shape)}")
    t, heads, d = qkv.shape
    if not 0 < num_rotated_heads <= heads:
        raise ValueError(f"num_rotated_heads must be in 1..{heads}, got {num_rotated_heads}")
    if d % 2:
        raise ValueError(f"head_size must be even, got {d}")
    if qkv.dtype not in SUPPORTED_DTYPES or qkv.stride(2) != 1:
        raise ValueError(f"qkv must be fp16/bf16/fp32 with a contiguous last dimension, got {qkv.dtype}, strides {qkv.stride()}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[0] != t or table.shape[1] < d // 2 or table.stride(1) != 1:
            raise ValueError(f"{name} must be [num_tokens={t}, head_size={d}] with contiguous rows, "
                             f"got shape {tuple(table.shape)}, strides {table.stride()}")
    if t:
        half = d // 2
        half_pad = next_power_of_two(half)
        per_program = min(next_power_of_two(num_rotated_heads), max(1, 512 // half_pad))
        _rotary_kernel[(t, triton.cdiv(num_rotated_heads, per_program))](
            qkv, cos, sin, qkv.stride(0), qkv.stride(1), cos.stride(0), sin.stride(0),
            NUM_ROTATED=num_rotated_heads, HALF=half, HALF_PAD=half_pad, HEADS_PER_PROGRAM=per_program,
            num_warps=4 if per_program * half_pad >= 512 else 1,
        )
