"""Benchmark of the paged-attention kernels against the GPU's own copy and matmul rates.

On a GPU (``python bench/kernels.py --out DIR``):

* measures device-to-device copy bandwidth (``dst.copy_(src)``, counted as bytes read + written)
  and the bf16 matmul rate (8192^3 ``torch.mm``) as the roofs;
* times decode (one new token per sequence) over batch sizes x context lengths, and prefill over
  chunk sizes with and without cached context, reporting achieved KV bandwidth (KV bytes that
  must be read / time), FLOP/s, and the ratio to ``scaled_dot_product_attention`` on the same data
  laid out contiguously (and to flash-attn's ``flash_attn_with_kvcache`` when installed);
* each timing is the median over many runs of a CUDA graph (no Python launch overhead in the
  number) that cycles through enough copies of the inputs to exceed 3x the L2 cache;
* writes ``DIR/bench.json``, ``DIR/decode.csv``, ``DIR/prefill.csv`` and ``DIR/bench.md``, and
  from the config sweep ``DIR/kernel_tuning.json``: the tiles each launch class ran fastest with
  (``bench/kernel_tuning.py``), which ``SIMKV_KERNEL_TUNING`` hands to the GPU backend.

``--dry-run`` runs the same code on CPU (Triton interpreter, tiny shapes, wall-clock timing) to
check the script itself; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from kernels.triton_attention import AttentionConfig, choose_config, triton_paged_attention  # noqa: E402
from kernels.triton_cache import triton_reshape_and_cache  # noqa: E402

sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # after the repository root: `kernels` is the package
from kernel_report import check_targets, markdown  # noqa: E402
from kernel_tuning import tuning_from_sweep, tuning_markdown  # noqa: E402

try:
    import flash_attn  # type: ignore  # noqa: F401

    HAVE_FLASH_ATTN = True
except Exception:
    HAVE_FLASH_ATTN = False


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
@dataclass
class Timer:
    device: torch.device
    warmup: int = 5
    iters: int = 40
    use_graphs: bool = True

    def median_ms(self, calls: list[Callable[[], object]]) -> float:
        """Median time of ONE call, cycling through ``calls`` (one per rotating input set)."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for c in calls:
                c()
            return (time.perf_counter() - t0) * 1e3 / len(calls)
        step = self._graph(calls) if self.use_graphs else None
        if step is None:
            def step():
                for c in calls:
                    c()
        for _ in range(self.warmup):
            step()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for s, e in zip(starts, ends):
            s.record()
            step()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / len(calls)

    @staticmethod
    def _graph(calls):
        try:
            for c in calls:  # compile / autotune outside the capture
                c()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for c in calls:
                    c()
            return graph.replay
        except Exception as exc:  # fall back to eager launches
            print(f"  (CUDA graph capture failed, timing eagerly: {type(exc).__name__}: {exc})", flush=True)
            torch.cuda.synchronize()
            return None


def rotation(bytes_per_set: int, l2_bytes: int, max_sets: int = 64) -> int:
    """How many distinct input sets make one cycle exceed 3x L2."""
    return max(1, min(max_sets, math.ceil(3 * l2_bytes / max(1, bytes_per_set))))


# ---------------------------------------------------------------------------------------------
# roofs
# ---------------------------------------------------------------------------------------------
def copy_bandwidths(timer: Timer, nbytes: int) -> dict[str, float]:
    """Device-to-device copy rates in bytes/s, counting read + write, three ways. The roof is the
    fastest: a `copy_` captured in a CUDA graph becomes a memcpy node, which the first H200 run
    timed at 2,761 GB/s, while this workplace's own check of the same GPU type saw a PyTorch copy
    move about 4.3 TB/s (and the first run's decode kernel read KV at up to 3,442 GB/s, so the
    memcpy node could not have been the roof). An elementwise kernel copies on the SMs."""
    src = torch.randn(nbytes // 4, device=timer.device)  # float32, random (never time zeros)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()
    eager = Timer(timer.device, timer.warmup, timer.iters, use_graphs=False)
    rates = {"memcpy in a graph": moved / (timer.median_ms([lambda: dst.copy_(src)]) * 1e-3),
             "memcpy, eager": moved / (eager.median_ms([lambda: dst.copy_(src)]) * 1e-3),
             "elementwise kernel": moved / (timer.median_ms([lambda: torch.neg(src, out=dst)]) * 1e-3)}
    return rates


def copy_roof(rates: dict[str, float]) -> dict:
    best = max(rates, key=rates.get)
    return {"copy_bytes_per_s": rates[best], "copy_method": best, "copy_rates": rates}


def matmul_rate(timer: Timer, n: int, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device=timer.device).to(dtype)
    b = torch.randn(n, n, device=timer.device).to(dtype)
    c = torch.empty(n, n, device=timer.device, dtype=dtype)
    ms = timer.median_ms([lambda: torch.mm(a, b, out=c)])
    return 2 * n**3 / (ms * 1e-3)


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------
@dataclass
class Model:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


@dataclass
class Case:
    """Uniform batch: ``num_seqs`` sequences, each ``context`` cached + ``q_len`` new tokens."""

    num_seqs: int
    context: int
    q_len: int
    sets: int = 1
    tensors: list = field(default_factory=list)  # per set: dict of kernel inputs

    @property
    def seq_len(self) -> int:
        return self.context + self.q_len


def kv_bytes(case: Case, m: Model) -> int:
    """KV bytes the kernel must read once: every sequence's whole context, K and V."""
    return case.num_seqs * case.seq_len * m.num_kv_heads * m.head_size * 2 * torch.finfo(m.dtype).bits // 8


def attention_flops(case: Case, m: Model) -> int:
    """2 matmuls x 2 FLOP per MAC over the causally visible (query, key) pairs."""
    visible = case.q_len * case.context + case.q_len * (case.q_len + 1) // 2
    return 4 * case.num_seqs * m.num_heads * m.head_size * visible


def build(case: Case, m: Model, device: torch.device, gen: torch.Generator) -> dict:
    """Paged inputs over a shuffled block pool, plus the same K/V laid out contiguously."""
    bs = m.block_size
    nb = -(-case.seq_len // bs)
    pool_blocks = case.num_seqs * nb
    shape = (pool_blocks, bs, m.num_kv_heads, m.head_size)
    k_cache = torch.randn(shape, device=device, dtype=torch.float32, generator=gen).to(m.dtype)
    v_cache = torch.randn(shape, device=device, dtype=torch.float32, generator=gen).to(m.dtype)
    perm = torch.randperm(pool_blocks, device=device, generator=gen).to(torch.int32)
    tables = perm.view(case.num_seqs, nb).contiguous()
    n_tok = case.num_seqs * case.q_len
    query = torch.randn((n_tok, m.num_heads, m.head_size), device=device, generator=gen).to(m.dtype)
    qsl = torch.arange(0, n_tok + 1, case.q_len, device=device, dtype=torch.int32)
    seq_lens = torch.full((case.num_seqs,), case.seq_len, device=device, dtype=torch.int32)
    # contiguous copies for the SDPA baseline: [num_seqs, num_kv_heads, seq_len, head_size]
    idx = tables.long()
    k_contig = k_cache[idx].reshape(case.num_seqs, nb * bs, m.num_kv_heads, m.head_size)[:, : case.seq_len]
    v_contig = v_cache[idx].reshape(case.num_seqs, nb * bs, m.num_kv_heads, m.head_size)[:, : case.seq_len]
    t = dict(
        query=query, key_cache=k_cache, value_cache=v_cache, block_tables=tables, seq_lens=seq_lens,
        query_start_loc=qsl, out=torch.empty_like(query),
        k_hnd=k_contig.transpose(1, 2).contiguous(), v_hnd=v_contig.transpose(1, 2).contiguous(),
        # the new tokens' K/V in token order (what config.new_kv reads instead of the cache)
        k_new=k_contig[:, case.context:].reshape(n_tok, m.num_kv_heads, m.head_size).contiguous(),
        v_new=v_contig[:, case.context:].reshape(n_tok, m.num_kv_heads, m.head_size).contiguous(),
    )
    if HAVE_FLASH_ATTN:  # [b, s, hkv, d], flash-attn's layout
        t.update(k_nhd=k_contig.contiguous(), v_nhd=v_contig.contiguous())
    return t


def paged_call(t: dict, case: Case, m: Model, config: AttentionConfig | None = None,
               max_query_len: int | None = None) -> Callable[[], object]:
    """`max_query_len`: the hint passed to the launcher (default: the case's query length; a
    larger one is still a valid upper bound, and for decode it launches the searched grid)."""
    scale = m.head_size ** -0.5
    return lambda: triton_paged_attention(
        t["query"], t["key_cache"], t["value_cache"], t["block_tables"], t["seq_lens"], t["query_start_loc"], scale,
        max_query_len=max_query_len or case.q_len, max_seq_len=case.seq_len, out=t["out"], config=config,
        key=t["k_new"] if config is not None and config.new_kv else None,
        value=t["v_new"] if config is not None and config.new_kv else None)


def sdpa_call(t: dict, case: Case, m: Model) -> Callable[[], object]:
    """SDPA on the contiguous copy.  Decode folds the query-head group into the query axis
    (exact for one query token), so the flash backend runs without GQA expansion."""
    b, qpk, hkv = case.num_seqs, m.num_heads // m.num_kv_heads, m.num_kv_heads
    scale = m.head_size ** -0.5
    if case.q_len == 1:
        q = t["query"].view(b, hkv, qpk, m.head_size)
        return lambda: F.scaled_dot_product_attention(q, t["k_hnd"], t["v_hnd"], scale=scale)
    q = t["query"].view(b, case.q_len, m.num_heads, m.head_size).transpose(1, 2)
    if case.context == 0:
        return lambda: F.scaled_dot_product_attention(q, t["k_hnd"], t["v_hnd"], is_causal=True, scale=scale, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(case.q_len, case.seq_len)
    return lambda: F.scaled_dot_product_attention(q, t["k_hnd"], t["v_hnd"], attn_mask=mask, scale=scale, enable_gqa=True)


def flash_attn_call(t: dict, case: Case, m: Model) -> Callable[[], object] | None:
    """flash-attn's kv-cache kernel on the contiguous copy, if the package is installed."""
    if not HAVE_FLASH_ATTN:
        return None
    from flash_attn import flash_attn_with_kvcache  # type: ignore

    q = t["query"].view(case.num_seqs, case.q_len, m.num_heads, m.head_size)
    lens = t["seq_lens"]
    return lambda: flash_attn_with_kvcache(q, t["k_nhd"], t["v_nhd"], cache_seqlens=lens, causal=True)


def max_abs_diff(t: dict, case: Case, m: Model) -> float:
    """Kernel vs SDPA on the first input set (sanity check that both compute the same thing)."""
    ours = paged_call(t, case, m)().float()
    ref = sdpa_call(t, case, m)()
    if case.q_len == 1:
        ref = ref.reshape(case.num_seqs, m.num_heads, m.head_size)
    else:
        ref = ref.transpose(1, 2).reshape(-1, m.num_heads, m.head_size)
    return float((ours - ref.float()).abs().max())


# ---------------------------------------------------------------------------------------------
# sweeps
# ---------------------------------------------------------------------------------------------
class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_case(kind: str, case: Case, m: Model, timer: Timer, l2: int, gen, roofs: dict, with_baselines: bool = True) -> dict:
    device = timer.device
    per_set = kv_bytes(case, m) * (3 if HAVE_FLASH_ATTN else 2)  # paged pool + contiguous layout(s)
    case.sets = rotation(kv_bytes(case, m), l2) if device.type == "cuda" else 1
    sets = [build(case, m, device, gen) for _ in range(case.sets)]
    row = dict(kind=kind, num_seqs=case.num_seqs, context=case.context, q_len=case.q_len, sets=case.sets,
               kv_bytes=kv_bytes(case, m), flops=attention_flops(case, m), mem_gib=round(per_set * case.sets / 2**30, 2))
    cfg = choose_config(qpk=m.num_heads // m.num_kv_heads, head_pad=max(16, 1 << (m.head_size - 1).bit_length()),
                        elem_size=torch.finfo(m.dtype).bits // 8, num_seqs=case.num_seqs, num_kv_heads=m.num_kv_heads,
                        max_query_len=case.q_len, max_seq_len=case.seq_len,
                        num_sms=torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8)
    row["config"] = f"M{cfg.block_m}/N{cfg.tile_n}/S{cfg.num_segments}/w{cfg.num_warps}"
    row["max_abs_diff_vs_sdpa"] = max_abs_diff(sets[0], case, m)
    ms = timer.median_ms([paged_call(t, case, m) for t in sets])
    row["paged_ms"] = ms
    # Options not yet the default, timed on every case with the heuristic's tiles (at least 3
    # stages): block ids a tile ahead, and for prefill also the step's own K/V for new-token
    # tiles. Each must give the default's output.
    variants = {"prefetch": replace(cfg, prefetch_ids=True, num_stages=max(3, cfg.num_stages))}
    if kind == "prefill":
        variants["newkv_prefetch"] = replace(variants["prefetch"], new_kv=True)
    paged_call(sets[0], case, m)()
    first = sets[0]["out"].float().clone()
    if kind == "decode":
        # the previous decode launch: grid over query tiles, each program searching for its
        # sequence (a query-length hint of 2 is a valid bound that turns the decode-only grid off)
        try:
            paged_call(sets[0], case, m, None, max_query_len=2)()
            row["search_max_diff"] = float((sets[0]["out"].float() - first).abs().max())
            row["search_ms"] = timer.median_ms([paged_call(t, case, m, None, max_query_len=2) for t in sets])
            row["decode_only_speedup"] = row["search_ms"] / ms
        except Exception as exc:
            row["search_error"] = f"{type(exc).__name__}: {exc}"[:200]
    for name, alt in variants.items():
        try:
            paged_call(sets[0], case, m, alt)()
            row[f"{name}_max_diff"] = float((sets[0]["out"].float() - first).abs().max())
            row[f"{name}_ms"] = timer.median_ms([paged_call(t, case, m, alt) for t in sets])
            row[f"{name}_speedup"] = ms / row[f"{name}_ms"]
        except Exception as exc:  # reported in the row; the default's figures stand
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    row["kv_gbps"] = row["kv_bytes"] / (ms * 1e-3) / 1e9
    row["pct_copy_bw"] = 100 * row["kv_bytes"] / (ms * 1e-3) / roofs["copy_bytes_per_s"]
    row["tflops"] = row["flops"] / (ms * 1e-3) / 1e12
    row["pct_matmul"] = 100 * row["flops"] / (ms * 1e-3) / roofs["matmul_flops"]
    if with_baselines:
        try:
            row["sdpa_ms"] = timer.median_ms([sdpa_call(t, case, m) for t in sets])
            row["sdpa_over_paged"] = row["sdpa_ms"] / ms
            if "prefetch_ms" in row:
                row["sdpa_over_prefetch"] = row["sdpa_ms"] / row["prefetch_ms"]
        except Exception as exc:
            row["sdpa_error"] = f"{type(exc).__name__}: {exc}"[:200]
        fa = [flash_attn_call(t, case, m) for t in sets]
        if fa[0] is not None:
            try:
                row["flash_attn_ms"] = timer.median_ms(fa)
                row["flash_attn_over_paged"] = row["flash_attn_ms"] / ms
            except Exception as exc:
                row["flash_attn_error"] = f"{type(exc).__name__}: {exc}"[:200]
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def cache_write_row(m: Model, timer: Timer, gen, n: int = 8192) -> dict:
    dev = timer.device
    key = torch.randn((n, m.num_kv_heads, m.head_size), device=dev, generator=gen).to(m.dtype)
    value = torch.randn_like(key)
    nb = 2 * n // m.block_size
    kc = torch.empty((nb, m.block_size, m.num_kv_heads, m.head_size), device=dev, dtype=m.dtype)
    vc = torch.empty_like(kc)
    slots = torch.randperm(nb * m.block_size, device=dev, generator=gen)[:n]
    ms = timer.median_ms([lambda: triton_reshape_and_cache(key, value, kc, vc, slots)])
    moved = 2 * 2 * key.numel() * key.element_size()  # read K,V + write K,V
    return dict(kind="reshape_and_cache", num_tokens=n, ms=ms, gbps=moved / (ms * 1e-3) / 1e9)


def layer_ops_rows(timer: Timer, gen, dtype: torch.dtype, roofs: dict, n: int = 8192, hidden: int = 4096,
                   inter: int = 14336, heads: int = 48, rotated: int = 40, head_size: int = 128) -> list[dict]:
    """The fused element-wise kernels of a llama-3-8b layer (`kernels/triton_layer_ops.py`) against
    the torch operators they replace, on n tokens: time, bytes that must move / time, and the
    torch / fused time ratio. Inputs are not rotated (n = 8192 puts each over 64 MiB)."""
    from kernels import layer_ops as ref
    from kernels import triton_layer_ops as fused

    dev = timer.device

    def rand(*shape):
        return torch.randn(shape, device=dev, generator=gen).to(dtype)

    x, res, w = rand(n, hidden), rand(n, hidden), rand(hidden)
    qkv = rand(n, heads, head_size)
    angles = torch.rand((n, head_size // 2), device=dev, generator=gen) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    gate_up = rand(n, 2 * inter)
    e = x.element_size()
    ops = [  # name, fused call, torch call, bytes that must move
        ("fused_add_rms_norm", lambda: fused.triton_fused_add_rms_norm(x, res, w, 1e-5),
         lambda: ref.ref_fused_add_rms_norm(x, res, w, 1e-5), 4 * n * hidden * e),
        ("rms_norm", lambda: fused.triton_rms_norm(x, w, 1e-5), lambda: ref.ref_rms_norm(x, w, 1e-5), 2 * n * hidden * e),
        ("rotary_embedding", lambda: fused.triton_rotary_embedding(qkv, cos, sin, rotated),
         lambda: ref.ref_rotary_embedding(qkv, cos, sin, rotated), 2 * n * rotated * head_size * e + 2 * n * head_size * e),
        ("silu_and_mul", lambda: fused.triton_silu_and_mul(gate_up), lambda: ref.ref_silu_and_mul(gate_up), 3 * n * inter * e),
    ]
    rows = []
    for name, fused_call, torch_call, moved in ops:
        row = dict(kind=name, num_tokens=n)
        try:
            row["fused_us"] = timer.median_ms([fused_call]) * 1e3
            row["torch_us"] = timer.median_ms([torch_call]) * 1e3
            row["gbps"] = moved / (row["fused_us"] * 1e-6) / 1e9
            row["pct_copy_bw"] = 100 * moved / (row["fused_us"] * 1e-6) / roofs["copy_bytes_per_s"]
            row["torch_over_fused"] = row["torch_us"] / row["fused_us"]
        except Exception as exc:  # one failing op must not lose the others
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
    return rows


def sweep_configs(m: Model, timer: Timer, l2: int, gen, roofs: dict, deadline: Deadline, dry: bool = False,
                  tma: bool = True) -> list[dict]:
    """A few alternative tile configs on representative cases (to retune the heuristic).
    `dry`: tiny versions of the cases and four configs each (checks the script on CPU).
    `tma=False`: leave out the configs that copy tiles by TMA (when this host's TMA tests failed)."""
    rows = []
    qpk = m.num_heads // m.num_kv_heads
    # (tile_n, segments, warps, stages, block ids prefetched). Each list starts with the launcher's
    # default and then the configs not yet measured on a GPU (prefetched block ids let Triton
    # pipeline the gathered K/V loads num_stages - 1 deep in sm_90 PTX, so they try 3 and 4 stages);
    # each case gets an equal share of the time left, so a short budget still compares the first few.
    decode = lambda rows: [AttentionConfig(max(16, qpk), n, s, w, st, False, pf) for n, s, w, st, pf in rows]
    # one cache block a tile by TMA copies (block ids an iteration ahead): (tile_n = block, segments, warps, stages)
    decode_tma = lambda rows: [AttentionConfig(max(16, qpk), n, s, w, st, tma_paged=True) for n, s, w, st in rows]
    # (block_m, tile_n, warps, stages, new K/V, block ids prefetched, new K/V by TMA copies)
    prefill = [AttentionConfig(bm, n, 1, w, st, nk, pf, tma) for bm, n, w, st, nk, pf, tma in
               [(128, 64, 8, 3, False, False, False), (128, 64, 8, 3, False, True, False),
                (128, 64, 8, 3, True, True, False), (128, 64, 8, 3, True, True, True),
                (128, 32, 4, 3, False, False, False), (128, 32, 4, 3, False, True, False),
                (128, 32, 4, 3, True, True, False), (128, 32, 4, 3, True, True, True),
                (128, 64, 8, 3, True, False, False), (128, 64, 8, 3, True, False, True),
                (128, 64, 8, 4, False, True, False), (128, 128, 8, 3, True, False, False),
                (128, 128, 8, 3, True, True, True), (128, 32, 8, 3, False, False, False),
                (128, 128, 8, 3, False, False, False), (128, 64, 8, 4, False, False, False),
                (128, 32, 8, 4, False, False, False), (64, 64, 4, 3, False, False, False)]]
    plans = [
        ("decode", Case(8, 32768, 1), decode([(64, 16, 4, 2, False), (64, 16, 4, 3, True), (64, 16, 4, 4, True)])
         + decode_tma([(m.block_size, 16, 4, 4), (m.block_size, 16, 4, 6)])
         + decode([(64, 16, 8, 3, True), (128, 16, 4, 3, True), (64, 16, 8, 3, False), (64, 16, 4, 1, False),
                   (32, 16, 4, 2, False), (128, 16, 4, 2, False), (64, 32, 4, 2, False), (64, 8, 4, 2, False)])),
        # large batch: where SDPA on contiguous KV was 1.3x faster in the first run
        ("decode", Case(128, 16384, 1), decode([(64, 1, 4, 2, False), (64, 1, 4, 3, True), (64, 1, 4, 4, True)])
         + decode_tma([(m.block_size, 1, 4, 4), (m.block_size, 1, 4, 6)])
         + decode([(64, 1, 8, 3, True), (128, 1, 4, 3, True), (64, 1, 8, 3, False), (32, 1, 4, 2, False),
                   (128, 1, 4, 2, False), (64, 2, 4, 2, False), (16, 1, 4, 2, False)])),
        # (block_m, tile_n, warps, stages, new K/V, block ids prefetched): the same candidates on a
        # fresh prompt and on a chunk after a long context (where new_kv only helps the chunk's own,
        # diagonal tiles), so that each can be judged on both (bench/kernel_tuning.py)
        ("prefill", Case(2, 0, 4096), prefill),
        ("prefill", Case(2, 8192, 2048), prefill),
    ]
    if not tma:
        plans = [(kind, case, [c for c in cfgs if not (c.tma_paged or c.tma_new_kv)]) for kind, case, cfgs in plans]
    if dry:
        tiny = [Case(2, 47, 1), Case(3, 47, 1), Case(1, 0, 64), Case(1, 32, 32)]
        plans = [(kind, t, [c for c in cfgs if not (c.new_kv or c.prefetch_ids or c.tma_paged)][:1]
                  + [c for c in cfgs if c.new_kv or c.prefetch_ids or c.tma_paged][:4]) for (kind, _, cfgs), t in zip(plans, tiny)]
    for i, (kind, case, cfgs) in enumerate(plans):
        plan_end = time.monotonic() + (deadline.left() - 20) / (len(plans) - i)
        case.sets = rotation(kv_bytes(case, m), l2)
        try:
            sets = [build(case, m, timer.device, gen) for _ in range(case.sets)]
        except Exception as exc:  # e.g. a CUDA fault left by an earlier config: keep what was measured
            rows.append(dict(kind=kind, num_seqs=case.num_seqs, context=case.context, q_len=case.q_len,
                             error=f"inputs not built: {type(exc).__name__}: {exc}"[:300]))
            print("  sweep", rows[-1], flush=True)
            continue
        baseline = None  # the first config's output: every other config must agree with it
        for cfg in cfgs:
            if deadline.left() < 20:
                return rows
            if time.monotonic() > plan_end:
                rows.append(dict(kind=kind, config=asdict(cfg), error="skipped: this case's share of the time budget is spent"))
                continue
            try:
                paged_call(sets[0], case, m, cfg)()
                result = sets[0]["out"].float().clone()
                if baseline is None:
                    baseline = result
                diff = float((result - baseline).abs().max())
                ms = timer.median_ms([paged_call(t, case, m, cfg) for t in sets])
                rows.append(dict(kind=kind, num_seqs=case.num_seqs, context=case.context, q_len=case.q_len,
                                 config=asdict(cfg), ms=ms, max_diff_vs_first=diff,
                                 pct_copy_bw=100 * kv_bytes(case, m) / (ms * 1e-3) / roofs["copy_bytes_per_s"],
                                 pct_matmul=100 * attention_flops(case, m) / (ms * 1e-3) / roofs["matmul_flops"]))
            except Exception as exc:
                rows.append(dict(kind=kind, config=asdict(cfg), error=f"{type(exc).__name__}: {exc}"[:300]))
            print("  sweep", rows[-1], flush=True)
        del sets
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--budget", type=float, default=240, help="seconds for the whole benchmark (cases past it are skipped)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile-config sweep")
    ap.add_argument("--no-tma", action="store_true", help="sweep no config that copies tiles by TMA")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpreter) to test the script")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    deadline = Deadline(args.budget)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark (use --dry-run to test the script on CPU)")
        return 2
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if dry:
        dtype = torch.float16
        m = Model(num_heads=4, num_kv_heads=1, head_size=64, block_size=16, dtype=dtype)
        decode = [Case(b, c - 1, 1) for b in (1, 2) for c in (16, 48)]
        prefill = [Case(1, ctx, q) for q in (16, 32) for ctx in (0, 16)]
        timer = Timer(device, warmup=0, iters=1)
        l2 = 0
        roofs = {**copy_roof(copy_bandwidths(timer, 1 << 20)), "matmul_flops": matmul_rate(timer, 128, torch.float32)}
    else:
        m = Model(dtype=dtype)
        batches, contexts, cap = (1, 8, 32, 128, 256), (1024, 4096, 16384, 32768, 131072), 1 << 22
        decode = [Case(b, c - 1, 1) for c in contexts for b in batches if b * c <= cap]
        prefill = [Case(max(1, 8192 // q), ctx, q) for q in (256, 1024, 4096, 8192) for ctx in (0, 8192)]
        timer = Timer(device)
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 50 << 20)
        roofs = {**copy_roof(copy_bandwidths(timer, 4 << 30)), "matmul_flops": matmul_rate(timer, 8192, dtype)}
    import triton

    env = dict(
        date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        gpu=torch.cuda.get_device_name(device) if not dry else f"CPU dry run ({platform.processor() or platform.machine()})",
        sms=torch.cuda.get_device_properties(device).multi_processor_count if not dry else 0,
        l2_mib=round(l2 / 2**20, 1), torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        model=f"{m.num_heads} q heads / {m.num_kv_heads} kv heads, head {m.head_size}, block {m.block_size}, {str(m.dtype).replace('torch.', '')}",
        model_dtype=str(m.dtype).replace("torch.", ""), dry_run=dry,
    )
    print(json.dumps(env), "\nroofs:", roofs, flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    result = dict(env=env, roofs=roofs, decode=[], prefill=[], skipped=[], sweep=[])
    # the decode cases that judge the targets run first, so a tight budget still answers them
    order = [("decode", c) for c in decode if c.seq_len >= 32768] + [("prefill", c) for c in prefill if c.q_len >= 4096]
    order += [("decode", c) for c in decode if c.seq_len < 32768] + [("prefill", c) for c in prefill if c.q_len < 4096]
    for kind, case in order:
        label = f"{kind} b={case.num_seqs} ctx={case.context} q={case.q_len}"
        if deadline.left() < (45 if not args.no_sweep and not dry else 10):
            result["skipped"].append(label)
            continue
        try:
            row = run_case(kind, case, m, timer, l2, gen, roofs)
            result[kind].append(row)
            print(" ", label, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        except Exception as exc:  # keep going: one failing case must not lose the others
            result["skipped"].append(f"{label} ({type(exc).__name__}: {str(exc)[:120]})")
            print("  FAILED", label, exc, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for kind in ("decode", "prefill"):
        result[kind].sort(key=lambda r: (r["q_len"], r["context"], r["num_seqs"]))
    try:
        result["cache_write"] = cache_write_row(m, timer, gen, n=32 if dry else 8192)
    except Exception as exc:
        result["cache_write_error"] = str(exc)[:200]
    result["layer_ops"] = (layer_ops_rows(timer, gen, dtype, roofs, n=4, hidden=64, inter=96, heads=6, rotated=5, head_size=16)
                           if dry else layer_ops_rows(timer, gen, m.dtype, roofs))
    result["targets"] = check_targets(result)
    write_results(args.out, result, [])  # before the sweep: a fault in one of its configs loses nothing above
    tuning_md = []
    if not args.no_sweep:
        result["sweep"] = sweep_configs(m, timer, l2, gen, roofs, deadline, dry, tma=not args.no_tma)
    if result["sweep"]:
        # the sweep's winners, for the launches of the GPU check's later steps (kernels/tuning.py)
        from kernels.tuning import write_tuning

        result["tuning"] = tuning_from_sweep(result["sweep"], env)
        write_tuning(os.path.join(args.out, "kernel_tuning.json"), result["tuning"])
        tuning_md = tuning_markdown(result["tuning"])
    write_results(args.out, result, tuning_md)
    print("\n".join(result["targets"]))
    return 0


def write_results(out: str, result: dict, tuning_md: list[str]) -> None:
    """bench.json, decode.csv, prefill.csv and bench.md (each to a temporary name, then renamed)."""
    def put(name: str, write) -> None:
        tmp = os.path.join(out, f".{name}.tmp")
        with open(tmp, "w", newline="") as f:
            write(f)
        os.replace(tmp, os.path.join(out, name))

    put("bench.json", lambda f: json.dump(result, f, indent=1, default=str))
    for kind in ("decode", "prefill"):
        rows = result[kind]
        if rows:
            keys = sorted({k for r in rows for k in r})

            def table(f, rows=rows, keys=keys):
                w = csv.DictWriter(f, fieldnames=keys)
                w.writeheader()
                w.writerows(rows)
            put(f"{kind}.csv", table)
    put("bench.md", lambda f: f.write(markdown(result) + "\n".join(tuning_md)))


if __name__ == "__main__":
    sys.exit(main())
