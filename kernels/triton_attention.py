"""Launching the paged-attention kernel (`triton_attention_kernel.py`): tile choice, argument
checks, and a launch planned once per step and run for every layer.

``triton_paged_attention`` is the one-call entry point (semantics of ``ref_paged_attention``);
``plan_paged_attention`` checks and configures a step once for a forward over many layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .layout import MAX_BLOCK_SIZE, SUPPORTED_DTYPES, is_power_of_two, next_power_of_two
from .triton_attention_kernel import LOG2E, _merge_segments_kernel, _paged_attention_kernel
from .tuning import KernelTuning

__all__ = ["AttentionConfig", "PagedAttentionLaunch", "choose_config", "plan_paged_attention",
           "triton_paged_attention", "_merge_segments_kernel", "_paged_attention_kernel"]

@dataclass(frozen=True)
class AttentionConfig:
    """Tile choices of one launch (all powers of two)."""

    block_m: int  # query rows per program (BLOCK_Q tokens x QPK heads, padded)
    tile_n: int  # keys per inner iteration
    num_segments: int  # KV splits (1 = no split, no merge kernel)
    num_warps: int
    num_stages: int
    new_kv: bool = False  # read key tiles of new tokens from the step's K/V (pass key=, value=)
    prefetch_ids: bool = False  # load block ids a tile ahead, so K/V pipeline num_stages - 1 deep
    tma_new_kv: bool = False  # with new_kv: read the new tokens' K/V tiles by TMA copies (tensor descriptors)
    tma_paged: bool = False  # read cache tiles by TMA copies, one block a tile (needs tile_n == block_size)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def choose_config(
    *,
    qpk: int,
    head_pad: int,
    elem_size: int,
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
    tuning: KernelTuning | None = None,
) -> AttentionConfig:
    """Heuristic tile choice: small query tiles + KV splitting for decode, big tiles for prefill.
    ``tuning`` (``kernels/tuning.py``) overrides the fp16/bf16 decode and prefill tiles with
    those a benchmark measured fastest on the device; the KV split stays the heuristic's."""
    min_m = max(16, next_power_of_two(qpk))
    if max_query_len * qpk <= min_m:
        # decode (or tiny chunks): memory bound; split the keys until the GPU is full
        # 4 warps / 2 stages: 0.276 ms against 0.344 ms with 8 warps / 3 stages on an H200 (8 x 32k
        # decodes, 16 segments; reports/gpu/2026-11-30_H200/summary.md, config sweep)
        over = dict(tile_n=64 if elem_size <= 2 else 32, num_warps=4, num_stages=2)
        if tuning is not None and elem_size <= 2:
            over.update(tuning.decode)
        programs = num_seqs * num_kv_heads
        kv_tiles = max(1, math.ceil(max_seq_len / over["tile_n"]))
        segments = 1
        while segments < 64 and programs * segments < 4 * num_sms and kv_tiles >= 4 * segments * 2:
            segments *= 2
        return AttentionConfig(min_m, num_segments=segments, **over)
    if max_query_len * qpk <= 64:
        return AttentionConfig(max(min_m, 64), 64 if elem_size <= 2 else 32, 1, num_warps=8, num_stages=3)
    if elem_size > 2 or head_pad > 128:
        # fp32 (exact-math path used by tests) or very wide heads: smaller tiles so nothing spills
        return AttentionConfig(max(min_m, 32), 16, 1, num_warps=8, num_stages=2)
    over = dict(block_m=128, tile_n=64, num_warps=8, num_stages=3)
    if tuning is not None:
        over.update(tuning.prefill)
    over["block_m"] = max(min_m, over["block_m"])
    return AttentionConfig(num_segments=1, **over)


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Scratch memory for device-side tensor descriptors (torch memory, so CUDA-graph capture pools it too)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _install_tma_allocator() -> None:
    """Device-side tensor descriptors (TMA) need scratch memory at launch; Triton asks the
    allocator set here. Triton keeps it per context (a ContextVar), so this checks each plan
    (every step) and sets it where none is set; an allocator of the caller's stays."""
    import triton

    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # another triton layout: set it, as triton documents
        pass
    triton.set_allocator(_tma_scratch)


def _tma_paged_unfit(key_cache: torch.Tensor, config: AttentionConfig) -> str | None:
    """Why cache tiles cannot be TMA copies here (None: they can): one tile must be one block,
    blocks contiguous runs of slots, rows 16-byte aligned, slot rows addressable in 31 bits."""
    num_blocks, block_size, _, head_size = key_cache.shape
    e = key_cache.element_size()
    s_blk, s_slot, s_head, _ = key_cache.stride()
    if config.tile_n != block_size:
        return f"a tile must be one cache block (tile_n {config.tile_n} != block_size {block_size})"
    if s_blk != block_size * s_slot:
        return "cache blocks are not contiguous runs of slots"
    if (s_slot * e) % 16 or (s_head * e) % 16 or (head_size * e) % 16:
        return "cache rows are not 16-byte aligned"
    if num_blocks * block_size >= 2**31:
        return "more than 2**31 cache slots"
    return None


def _check_tma_rows(key: torch.Tensor, value: torch.Tensor) -> None:
    """TMA copies rows whose start, stride and length are multiples of 16 bytes."""
    e = key.element_size()
    for name, t in (("key", key), ("value", value)):
        if t.data_ptr() % 16 or (t.stride(0) * e) % 16 or (t.stride(1) * e) % 16 or (t.shape[2] * e) % 16:
            raise ValueError(f"tma_new_kv needs {name} rows aligned to 16 bytes (address {t.data_ptr()}, strides "
                             f"{t.stride()}, head size {t.shape[2]}, {e}-byte elements): use new_kv without TMA")


def _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache/value_cache must both be [num_blocks, block_size, num_kv_heads, head_size], "
            f"got {tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        )
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"key_cache and value_cache strides differ: {key_cache.stride()} vs {value_cache.stride()}")
    _, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"cache head_size {cache_head_size} != query head_size {head_size}")
    if head_size < 16:
        raise ValueError(f"head_size must be >= 16, got {head_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if not is_power_of_two(block_size) or block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be a power of two <= {MAX_BLOCK_SIZE}, got {block_size}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} not supported (use one of {SUPPORTED_DTYPES})")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"cache dtypes {key_cache.dtype}/{value_cache.dtype} must equal query dtype {query.dtype}")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride {t.stride(-1)})")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be a contiguous 1-D tensor, got shape {tuple(seq_lens.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1 or not query_start_loc.is_contiguous():
        raise ValueError(f"query_start_loc must be contiguous [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks] with stride 1 rows, got {tuple(block_tables.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")


class PagedAttentionLaunch:
    """One step's attention, validated and configured once, launched for every layer.

    Every layer of a step attends with the same block tables, sequence lengths and query offsets,
    and its query and caches have the same shapes and strides; only the tensors differ. vLLM
    builds its attention metadata once per step for the same reason. Checking the arguments and
    choosing tiles costs about as much host time as the launch itself, so a forward plans the
    step at its first layer (``plan_paged_attention``) and later layers only compare shapes and
    strides with the plan and launch. The split-KV scratch is allocated once and reused layer
    after layer (stream order keeps them apart, also inside a CUDA graph).
    """

    def __init__(self, query, key_cache, block_tables, seq_lens, query_start_loc, scale: float,
                 config: AttentionConfig, decode_only: bool = False) -> None:
        num_tokens, num_heads, head_size = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        num_seqs = seq_lens.shape[0]
        self.config = config
        self.query_shape, self.query_stride, self.dtype = query.shape, query.stride(), query.dtype
        self.cache_shape, self.cache_stride, self.device = key_cache.shape, key_cache.stride(), query.device
        self.empty = num_tokens == 0 or num_seqs == 0
        qpk = num_heads // num_kv_heads
        head_pad = max(16, next_power_of_two(head_size))
        block_q = config.block_m // qpk
        segs = config.num_segments
        interp = _interpreting()
        if segs > 1 and not self.empty:
            self.part_acc = torch.empty((num_tokens, num_heads, segs, head_pad), dtype=torch.float32, device=query.device)
            self.part_ml = torch.empty((2, num_tokens, num_heads, segs), dtype=torch.float32, device=query.device)
        else:
            self.part_acc = self.part_ml = None
        self.decode_only = decode_only
        tiles = num_seqs if decode_only else num_tokens // block_q + num_seqs
        self.grid = (tiles * num_kv_heads, segs)
        self.merge_grid = (num_tokens, num_heads)
        self.metadata = (block_tables, seq_lens, query_start_loc, float(scale) * LOG2E, num_seqs, num_heads,
                         num_kv_heads, num_tokens * num_heads * segs)
        self.strides = (query.stride(0), query.stride(1))
        self.cache_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0))
        self.constexprs = dict(
            QPK=qpk, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, TILE_N=config.tile_n,
            BLOCK_Q=block_q, BLOCK_M=config.block_m, NUM_SEGMENTS=segs,
            DOT_FP32=query.dtype == torch.float32 or (interp and query.dtype == torch.bfloat16),
            DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
            NEW_KV=config.new_kv, PREFETCH_IDS=config.prefetch_ids, TMA_NEW=config.tma_new_kv,
            TMA_PAGED=config.tma_paged, num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        self.merge_args = (query_start_loc, num_seqs, num_heads, num_tokens * num_heads * segs)
        self.merge_constexprs = dict(HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SEGMENTS=segs, num_warps=4)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
                 out: torch.Tensor | None = None, key: torch.Tensor | None = None,
                 value: torch.Tensor | None = None) -> torch.Tensor:
        if (query.shape != self.query_shape or query.stride() != self.query_stride or query.dtype != self.dtype
                or query.device != self.device or key_cache.shape != self.cache_shape
                or key_cache.stride() != self.cache_stride or value_cache.shape != self.cache_shape
                or value_cache.stride() != self.cache_stride or key_cache.dtype != self.dtype
                or value_cache.dtype != self.dtype or key_cache.device != self.device or value_cache.device != self.device):
            raise ValueError(
                f"this attention launch was planned for query {tuple(self.query_shape)} strides {self.query_stride} "
                f"{self.dtype} and caches {tuple(self.cache_shape)} strides {self.cache_stride}; got query "
                f"{tuple(query.shape)} strides {query.stride()} {query.dtype}, caches {tuple(key_cache.shape)} "
                f"strides {key_cache.stride()} / {value_cache.stride()}")
        if out is None:
            out = torch.empty_like(query)
        elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(-1) != 1:
            raise ValueError(f"out must match query's shape/dtype/device with stride-1 last dim, got {tuple(out.shape)} {out.dtype}")
        if self.empty:
            return out
        num_tokens, _, head_size = self.query_shape
        if self.config.tma_paged and (key_cache.data_ptr() % 16 or value_cache.data_ptr() % 16):
            raise ValueError("tma_paged needs 16-byte aligned caches")
        if self.config.new_kv:
            num_kv_heads = self.cache_shape[2]
            for name, t in (("key", key), ("value", value)):
                if t is None or t.shape != (num_tokens, num_kv_heads, head_size) or t.stride(-1) != 1 \
                        or t.dtype != query.dtype or t.device != query.device:
                    raise ValueError(f"config.new_kv needs {name} [num_tokens={num_tokens}, {num_kv_heads}, {head_size}] "
                                     f"of the query's dtype and device with a contiguous last dimension")
            if self.config.tma_new_kv:
                _check_tma_rows(key, value)
            k_new, v_new = key, value
        else:
            k_new = v_new = query  # unused
        part_acc = self.part_acc if self.part_acc is not None else out  # unused without a split
        part_ml = self.part_ml if self.part_ml is not None else out
        _paged_attention_kernel[self.grid](
            out, part_acc, part_ml, query, key_cache, value_cache, *self.metadata,
            *self.strides, out.stride(0), out.stride(1), *self.cache_strides,
            k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            int(self.decode_only), **self.constexprs,
        )
        if self.part_acc is not None:
            _merge_segments_kernel[self.merge_grid](
                out, part_acc, part_ml, *self.merge_args, out.stride(0), out.stride(1), **self.merge_constexprs,
            )
        return out


def plan_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         scale: float, *, max_query_len: int | None = None, max_seq_len: int | None = None,
                         config: AttentionConfig | None = None, num_segments: int | None = None,
                         tuning: KernelTuning | None = None) -> PagedAttentionLaunch:
    """Check the arguments (as ``triton_paged_attention`` takes them) and choose the tiles once;
    the returned launch runs any layer whose query and caches have these shapes and strides
    (see ``PagedAttentionLaunch``). ``tuning`` steers the tile choice when ``config`` is None; a
    tuning with ``new_kv`` needs the step's K/V passed to each launch (``key=``, ``value=``)."""
    _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    _, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    qpk = num_heads // num_kv_heads
    if query.shape[0] and num_seqs:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
    tuned = config is None
    if config is None:
        config = choose_config(
            qpk=qpk, head_pad=max(16, next_power_of_two(head_size)), elem_size=query.element_size(),
            num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_query_len=max_query_len or 1,
            max_seq_len=max_seq_len or 1, num_sms=_num_sms(query.device), tuning=tuning,
        )
    if num_segments is not None:
        config = replace(config, num_segments=num_segments)
    if not (is_power_of_two(config.block_m) and is_power_of_two(config.tile_n) and is_power_of_two(config.num_segments)):
        raise ValueError(f"config sizes must be powers of two: {config}")
    if config.block_m < qpk or config.tile_n < 16 or config.block_m < 16:
        raise ValueError(f"config too small for qpk={qpk}: {config}")
    if config.tma_new_kv and not config.new_kv:
        raise ValueError(f"tma_new_kv reads the new_kv tiles: it needs new_kv=True ({config})")
    if config.tma_paged:
        why = _tma_paged_unfit(key_cache, config)
        if why and tuned:  # a device's tuning is not a promise for every pool: this launch reads by pointers
            config = replace(config, tma_paged=False)
        elif why:
            raise ValueError(f"tma_paged: {why} ({config})")
    if config.tma_new_kv or config.tma_paged:
        _install_tma_allocator()
    # no query longer than one token: one program row per sequence (a sequence without a token
    # exits at once; tokens past the batch, e.g. graph padding, are left unwritten as before)
    decode_only = bool(num_seqs) and max_query_len is not None and max_query_len <= 1
    return PagedAttentionLaunch(query, key_cache, block_tables, seq_lens, query_start_loc, scale, config,
                                decode_only)


def triton_paged_attention(
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
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
    config: AttentionConfig | None = None,
    num_segments: int | None = None,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]: this step's new K (config.new_kv)
    value: torch.Tensor | None = None,  # the same for V
) -> torch.Tensor:
    """Launch the unified paged-attention kernel; semantics as ``ref_paged_attention``.

    ``max_query_len``/``max_seq_len`` steer the tile heuristic; pass them to avoid a
    device-to-host sync. ``max_query_len`` must not be below the longest query: 1 launches the
    decode-only grid (one program row per sequence, no search for a program's sequence).  ``config``/``num_segments`` override the heuristic (tests, benchmarks).
    Output rows of tokens past ``query_start_loc[-1]`` (batch padding) are left unwritten.
    One call plans and launches; a forward over many layers plans once (``plan_paged_attention``).
    """
    launch = plan_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                  max_query_len=max_query_len, max_seq_len=max_seq_len, config=config,
                                  num_segments=num_segments)
    return launch(query, key_cache, value_cache, out=out, key=key, value=value)
