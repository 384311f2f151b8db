"""The benchmark's choice of tuned tiles from its config sweep (bench/kernel_tuning.py), on
hand-made sweep rows: a candidate wins only on every case of its class, with the default's
output and KV split and no real loss on any, and is adopted only past the stated gain."""
import importlib.util
from pathlib import Path

from kernels.tuning import tuning_from_dict

_path = Path(__file__).resolve().parents[2] / "bench" / "kernel_tuning.py"
_spec = importlib.util.spec_from_file_location("kernel_tuning", _path)
bt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bt)

ENV = {"gpu": "NVIDIA H200", "model_dtype": "bfloat16", "torch": "2.11", "triton": "3.6.0", "date": "d"}


def row(kind, case, ms, *, bm=16, n=64, s=1, w=4, st=2, nk=False, pf=False, diff=0.0):
    num_seqs, context, q_len = case
    return dict(kind=kind, num_seqs=num_seqs, context=context, q_len=q_len, ms=ms, max_diff_vs_first=diff,
                config=dict(block_m=bm, tile_n=n, num_segments=s, num_warps=w, num_stages=st, new_kv=nk, prefetch_ids=pf))


SMALL, LARGE = (8, 32768, 1), (128, 16384, 1)


def decode_rows(prefetch_small, prefetch_large, **extra):
    return [row("decode", SMALL, 1.0, s=16), row("decode", SMALL, prefetch_small, s=16, st=3, pf=True, **extra),
            row("decode", SMALL, 0.5, s=32),  # another KV split: not a tile candidate
            row("decode", LARGE, 2.0), row("decode", LARGE, 2.0 * prefetch_large, st=3, pf=True)]


def test_a_candidate_faster_on_every_case_is_adopted():
    rec = bt.tuning_from_sweep(decode_rows(0.8, 0.9), ENV)
    assert rec["decode"] == {"tile_n": 64, "num_warps": 4, "num_stages": 3, "prefetch_ids": True, "tma_paged": False}
    ev = rec["evidence"]["decode"]
    assert ev["adopted"] and abs(ev["ratio"] - (0.8 * 0.9) ** 0.5) < 1e-4
    assert ev["cases"]["8x(32768+1)"] == {"default_ms": 1.0, "best_ms": 0.8}
    assert "prefill" not in rec and "prefill" not in rec["evidence"]  # no prefill rows: no verdict
    assert tuning_from_dict(rec).decode == rec["decode"]  # a valid tuning file
    assert any("decode: adopted" in line for line in bt.tuning_markdown(rec))


def test_gains_below_the_threshold_or_on_one_case_only_keep_the_heuristic():
    rec = bt.tuning_from_sweep(decode_rows(0.99, 0.98), ENV)  # about 1.5 %: noise
    assert "decode" not in rec and "< 3%" in rec["evidence"]["decode"]["why"]
    rec = bt.tuning_from_sweep(decode_rows(0.5, 1.1), ENV)  # much faster on one case, 10 % slower on the other
    assert "decode" not in rec and rec["evidence"]["decode"]["why"] == "the default is fastest"
    rows = decode_rows(0.5, 0.5)
    del rows[-1]["ms"]  # failed (no time) on the large batch: not eligible
    rows[-1]["error"] = "OutOfResources"
    assert "decode" not in bt.tuning_from_sweep(rows, ENV)


def test_a_candidate_whose_output_differs_is_never_chosen():
    rec = bt.tuning_from_sweep(decode_rows(0.5, 0.5, diff=0.5), ENV)
    assert "decode" not in rec and rec["evidence"]["decode"]["why"] == "the default is fastest"


def test_prefill_candidates_are_judged_on_fresh_and_chunked_cases_together():
    fresh, chunk = (2, 0, 4096), (2, 8192, 2048)
    rows = [row("prefill", fresh, 1.0, bm=128, w=8, st=3), row("prefill", fresh, 0.7, bm=128, n=32, w=4, st=3, nk=True),
            row("prefill", fresh, 0.6, bm=64, w=4, st=3),  # fastest on the fresh case, not timed on the chunk
            row("prefill", chunk, 5.0, bm=128, w=8, st=3), row("prefill", chunk, 4.5, bm=128, n=32, w=4, st=3, nk=True)]
    rec = bt.tuning_from_sweep(rows, ENV)
    assert rec["prefill"] == {"block_m": 128, "tile_n": 32, "num_warps": 4, "num_stages": 3, "prefetch_ids": False,
                              "new_kv": True, "tma_new_kv": False}
    assert rec["evidence"]["prefill"]["candidates"] == 2
