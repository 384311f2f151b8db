"""KV-cache layout shared by the kernels and the GPU backend.

Per layer there is one K cache and one V cache, each a 4-D tensor

    [num_blocks, block_size, num_kv_heads, head_size]

(the *slot* of token ``t`` of a sequence is ``block_table[t // block_size] * block_size
+ t % block_size``; a flat slot index ``s`` lives at ``cache[s // block_size, s % block_size]``).
The last dimension must be contiguous (stride 1); the other strides are free, so K and V may
be two views into one ``[2, num_blocks, ...]`` allocation.  All offsets the kernels compute
from these strides are 64-bit, so a pool may exceed 2**31 elements.

``block_size`` must be a power of two (16 and 32 are the usual values; at most 128).
``head_size`` may be any of 64, 80, 96, 128 (others work as long as they are >= 16): the
kernels pad it to the next power of two and mask the tail.
"""
from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK_SIZE = 128


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, int, int, int]:
    """Shape of ONE of the two per-layer caches (K or V)."""
    return (num_blocks, block_size, num_kv_heads, head_size)


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    fill: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the (key_cache, value_cache) pair of one layer.

    Both are views into a single ``[2, num_blocks, block_size, num_kv_heads, head_size]``
    buffer.  ``fill`` (e.g. ``float('nan')`` in tests) initialises every slot; ``None``
    leaves the memory uninitialised.
    """
    if not is_power_of_two(block_size) or block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be a power of two <= {MAX_BLOCK_SIZE}, got {block_size}")
    shape = (2,) + kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    if fill is None:
        buf = torch.empty(shape, dtype=dtype, device=device)
    else:
        buf = torch.full(shape, fill, dtype=dtype, device=device)
    return buf[0], buf[1]


def slot_mapping_for(block_table: list[int] | torch.Tensor, positions: range | list[int], block_size: int) -> list[int]:
    """Flat slot index of each token position of one sequence (helper for tests and the backend)."""
    table = block_table.tolist() if isinstance(block_table, torch.Tensor) else list(block_table)
    return [int(table[p // block_size]) * block_size + p % block_size for p in positions]
