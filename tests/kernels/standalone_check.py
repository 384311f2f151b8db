"""Kernel correctness check without pytest (fallback for GPU hosts that lack it).

    python tests/kernels/standalone_check.py [--device cuda|cpu] [--json FILE]

Runs the same scenarios as the pytest suite (NaN-poisoned shuffled pools, sequences of length 1,
exactly one block, one token past a block boundary, GQA 1/4/8, head sizes, block sizes, dtypes,
KV splits, and on CUDA realistic shapes and a pool past 2**31 elements) against the torch
reference, prints one line per case and exits non-zero if any case fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.abspath(os.path.join(HERE, "..", ".."))]

if "--device" not in sys.argv or "cpu" in sys.argv:
    import torch as _t

    if not _t.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from kernel_cases import assert_close_to_reference, make_batch  # noqa: E402

from kernels import ref_paged_attention, ref_reshape_and_cache  # noqa: E402
from kernels.triton_attention import AttentionConfig, triton_paged_attention  # noqa: E402
from kernels.triton_cache import triton_reshape_and_cache  # noqa: E402


def scenarios(bs: int) -> dict:
    return {
        "single_token": [(0, 1)],
        "one_block": [(bs - 1, 1), (0, bs)],
        "past_boundary": [(bs, 1), (0, bs + 1), (bs + 1, 2)],
        "mixed": [(0, 5), (2 * bs + 3, 1), (bs - 2, 6)],
    }


def cases(device: str):
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        for qpk in (1, 4, 8):
            for head, bs in ((64, 16), (80, 32)) + (((96, 16), (128, 32)) if device == "cuda" else ()):
                for name, seqs in scenarios(bs).items():
                    hkv = 2 if qpk == 1 else 1
                    yield (f"attn/{name}/{str(dtype)[6:]}/qpk{qpk}/d{head}/bs{bs}",
                           dict(seqs=seqs, num_heads=hkv * qpk, num_kv_heads=hkv, head_size=head, block_size=bs, dtype=dtype), {})
    for segs in (2, 4):
        yield (f"attn/split_kv{segs}", dict(seqs=[(40, 1), (5, 1), (30, 3)], num_heads=8, num_kv_heads=2, head_size=64,
                                              block_size=16, dtype=torch.float32),
               dict(config=AttentionConfig(16, 16, segs, 4, 2)))
    if device == "cuda":
        for dtype in (torch.float16, torch.bfloat16):
            for bs in (16, 32, 128):
                yield (f"attn/llama_like/{str(dtype)[6:]}/bs{bs}",
                       dict(seqs=[(0, 1000), (3000, 1), (2000, 300), (100, 1), (511, 513), (16383, 1)], num_heads=32,
                            num_kv_heads=8, head_size=128, block_size=bs, dtype=dtype), {})
        per_block = 16 * 8 * 128
        first = (2**31 + per_block - 1) // per_block + 24
        yield ("attn/pool_beyond_int32", dict(seqs=[(300, 1), (0, 40), (100, 20)], num_heads=32, num_kv_heads=8, head_size=128,
                                              block_size=16, dtype=torch.float16, first_block=first), {})


def run_attention(device: str, spec: dict, kwargs: dict) -> None:
    spec = dict(spec)
    batch = make_batch(spec.pop("seqs"), device=device, **spec)
    out = triton_paged_attention(*batch.args(), **kwargs)
    assert_close_to_reference(out, ref_paged_attention(*batch.args()), batch.query.dtype)


def run_cache_write(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn((9, 2, 80), generator=gen).to(device=device, dtype=dtype)
    value = torch.randn((9, 2, 80), generator=gen).to(device=device, dtype=dtype)
    slots = torch.tensor([5, -1, 0, 63, 17, -1, 40, 33, 2], dtype=torch.int64, device=device)
    kc = torch.full((4, 16, 2, 80), float("nan"), dtype=dtype, device=device)
    vc = kc.clone()
    kr, vr = kc.clone(), vc.clone()
    triton_reshape_and_cache(key, value, kc, vc, slots)
    ref_reshape_and_cache(key, value, kr, vr, slots)
    torch.testing.assert_close(kc, kr, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, vr, atol=0, rtol=0, equal_nan=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    todo = [(f"cache_write/{str(dt)[6:]}", run_cache_write, (args.device, dt))
            for dt in (torch.float16, torch.float32, torch.bfloat16)]
    todo += [(name, run_attention, (args.device, spec, kw)) for name, spec, kw in cases(args.device)]
    for name, fn, fargs in todo:
        t0 = time.time()
        try:
            fn(*fargs)
            status, err = "pass", ""
        except Exception as exc:
            status, err = "FAIL", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        results.append(dict(case=name, status=status, seconds=round(time.time() - t0, 2), error=err[:500]))
        print(f"{status} {name} ({results[-1]['seconds']}s) {err[:200]}", flush=True)
    failed = sum(r["status"] != "pass" for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=args.device, passed=len(results) - failed, failed=failed, cases=results), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
