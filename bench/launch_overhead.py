"""Host time of our kernel wrappers per call, with the kernel launch itself replaced by a no-op.

    python bench/launch_overhead.py [--tokens 512] [--calls 2000]

An eager GPU-backend step calls each wrapper once per layer (32 layers for llama-3-8b). On
CUDA the launches are asynchronous, so a step whose host work outlasts its GPU work is bound by
this Python time plus Triton's own launch cost. The script measures only our part: argument
checks, tile choice, scratch allocation and argument assembly, for a one-call launch and for a
launch planned once per step (`plan_paged_attention`, `plan_reshape_and_cache`). It runs on
any machine (CPU tensors, llama-3-8b shapes); absolute figures depend on the host's CPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors are accepted; no kernel runs anyway
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5, help="median over this many rounds of --calls")
    args = p.parse_args(argv)

    import torch

    import kernels.triton_attention as attention
    import kernels.triton_cache as cache
    import kernels.triton_layer_ops as layer_ops

    for module, names in ((attention, ("_paged_attention_kernel", "_merge_segments_kernel")),
                          (cache, ("_reshape_and_cache_kernel",)),
                          (layer_ops, ("_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"))):
        for name in names:
            setattr(module, name, _NoLaunch())

    t, nh, nkv, d, hidden, inter, seqs, block = args.tokens, 32, 8, 128, 4096, 14336, 8, 16
    dt = torch.bfloat16
    qkv = torch.zeros(t, nh + 2 * nkv, d, dtype=dt)
    q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
    per_seq = t // seqs
    pool = torch.zeros(2, seqs * (per_seq // block + 1), block, nkv, d, dtype=dt)
    key_cache, value_cache = pool[0], pool[1]
    tables = torch.arange(seqs * (per_seq // block + 1), dtype=torch.int32).view(seqs, -1)
    seq_lens = torch.full((seqs,), per_seq, dtype=torch.int32)
    qsl = torch.arange(0, (seqs + 1) * per_seq, per_seq, dtype=torch.int32)
    slots = torch.arange(t, dtype=torch.int64)
    x, w = torch.zeros(t, hidden, dtype=dt), torch.zeros(hidden, dtype=dt)
    cos = torch.zeros(t, d, dtype=dt)
    gate_up = torch.zeros(t, 2 * inter, dtype=dt)
    meta = dict(max_query_len=per_seq, max_seq_len=per_seq)
    launch = attention.plan_paged_attention(q, key_cache, value_cache, tables, seq_lens, qsl, 0.1, **meta)
    write = cache.plan_reshape_and_cache(k, v, key_cache, value_cache, slots)
    cases = {
        "attention, one call": lambda: attention.triton_paged_attention(q, key_cache, value_cache, tables, seq_lens,
                                                                        qsl, 0.1, **meta),
        "attention, planned": lambda: launch(q, key_cache, value_cache),
        "KV write, one call": lambda: cache.triton_reshape_and_cache(k, v, key_cache, value_cache, slots),
        "KV write, planned": lambda: write(k, v, key_cache, value_cache),
        "fused_add_rms_norm": lambda: layer_ops.triton_fused_add_rms_norm(x, x, w, 1e-5),
        "rotary_embedding": lambda: layer_ops.triton_rotary_embedding(qkv, cos, cos, nh + nkv),
        "silu_and_mul": lambda: layer_ops.triton_silu_and_mul(gate_up),
    }
    print(f"host us per call, {t} tokens, llama-3-8b shapes, median of {args.rounds} x {args.calls} calls "
          f"(torch {torch.__version__})")
    results = {}
    for name, fn in cases.items():
        fn()
        rounds = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            rounds.append((time.perf_counter() - t0) / args.calls * 1e6)
        results[name] = statistics.median(rounds)
        print(f"  {name:22s} {results[name]:7.1f}")
    saved = (results["attention, one call"] - results["attention, planned"]
             + results["KV write, one call"] - results["KV write, planned"])
    print(f"planning saves {saved:.1f} us per layer, {32 * saved / 1e3:.2f} ms per 32-layer eager step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
