"""Builders shared by the kernel tests: random paged batches over a shuffled, NaN-filled pool."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# per-dtype tolerances (absolute, relative) of kernel vs fp32 reference; outputs are O(1)
TOLERANCES = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_params() -> list:
    """``cpu`` (Triton interpreter) and ``cuda`` (compiled); each skipped where it cannot run."""
    import pytest  # imported here so the standalone checker runs where pytest is missing

    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET not set")),
        pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
    ]


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float
    max_query_len: int
    max_seq_len: int

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def make_batch(
    seqs: list[tuple[int, int]],  # (cached context length, new query tokens) per sequence
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    spare_blocks: int = 3,
    seed: int = 0,
    first_block: int = 0,
) -> PagedBatch:
    """Blocks are drawn from a shuffled pool; every slot a sequence does not own is NaN.

    Table entries past a sequence's last block point at NaN-only spare blocks, and the tail of
    each sequence's last block is NaN too, so any out-of-range read poisons the output.
    ``first_block`` offsets every used block id (to place data at the end of a huge pool).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in seqs]
    used = sum(blocks_per_seq)
    num_blocks = used + spare_blocks
    max_blocks = max(blocks_per_seq) + 2
    k_cache = torch.full((first_block + num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = (torch.randperm(num_blocks, generator=gen) + first_block).tolist()
    spare = perm[used:] or [perm[-1]]
    tables = torch.empty((len(seqs), max_blocks), dtype=torch.int32)
    nxt = 0
    for i, ((ctx, q), nb) in enumerate(zip(seqs, blocks_per_seq)):
        seq_len = ctx + q
        own = perm[nxt:nxt + nb]
        nxt += nb
        row = own + [spare[(i + j) % len(spare)] for j in range(max_blocks - nb)]
        tables[i] = torch.tensor(row, dtype=torch.int32)
        k = torch.randn((seq_len, num_kv_heads, head_size), generator=gen)
        v = torch.randn((seq_len, num_kv_heads, head_size), generator=gen)
        for b, blk in enumerate(own):
            lo, hi = b * block_size, min(seq_len, (b + 1) * block_size)
            k_cache[blk, : hi - lo] = k[lo:hi].to(device=device, dtype=dtype)
            v_cache[blk, : hi - lo] = v[lo:hi].to(device=device, dtype=dtype)
    q_lens = [q for _, q in seqs]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn((qsl[-1], num_heads, head_size), generator=gen).to(device=device, dtype=dtype)
    return PagedBatch(
        query=query,
        key_cache=k_cache,
        value_cache=v_cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        scale=head_size ** -0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(c + q for c, q in seqs),
    )


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """No NaN anywhere (so no poisoned slot was read) and within the dtype's tolerance."""
    assert not torch.isnan(ref).any(), "reference read a NaN slot: the test batch is malformed"
    assert not torch.isnan(out).any(), "kernel output has NaN: it read a slot outside a sequence's blocks"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


def new_kv_of(batch: PagedBatch, seqs: list[tuple[int, int]], fused_heads: int = 0):
    """The new tokens' K and V of each sequence, in query order (gathered from the cache), as
    strided views of a wider tensor when `fused_heads` > 0 (as a fused QKV projection gives)."""
    bs = batch.key_cache.shape[1]
    ks, vs = [], []
    for i, (ctx, q) in enumerate(seqs):
        for pos in range(ctx, ctx + q):
            blk = int(batch.block_tables[i, pos // bs])
            ks.append(batch.key_cache[blk, pos % bs])
            vs.append(batch.value_cache[blk, pos % bs])
    k, v = torch.stack(ks), torch.stack(vs)
    if fused_heads:
        n, hkv, d = k.shape
        wide = torch.zeros((n, fused_heads + 2 * hkv, d), dtype=k.dtype, device=k.device)
        wide[:, fused_heads:fused_heads + hkv], wide[:, fused_heads + hkv:] = k, v
        k, v = wide[:, fused_heads:fused_heads + hkv], wide[:, fused_heads + hkv:]
    return k, v
