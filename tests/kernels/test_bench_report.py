"""The GPU benchmark's target verdicts (bench/kernel_report.py), on hand-made result rows: the
verdict lines the GPU check copies into reports/kernels.md must say MET exactly when the
measured figures reach the issue's targets."""
import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[2] / "bench" / "kernel_report.py"
_spec = importlib.util.spec_from_file_location("kernel_report", _path)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _decode(context, pct, sdpa_ratio, **extra):
    return dict(num_seqs=8, context=context, q_len=1, config="M16/N64/S16/w4", paged_ms=0.3, kv_gbps=3000.0,
                pct_copy_bw=pct, sdpa_ms=0.3 * sdpa_ratio, sdpa_over_paged=sdpa_ratio, max_abs_diff_vs_sdpa=1e-4, **extra)


def _prefill(q_len, pct, **extra):
    return dict(num_seqs=2, context=0, q_len=q_len, config="M128/N64/S1/w8", paged_ms=1.0, tflops=300.0,
                pct_matmul=pct, max_abs_diff_vs_sdpa=1e-3, **extra)


def test_verdicts_follow_the_targets():
    result = {"decode": [_decode(1024, 20.0, 0.5), _decode(32767, 85.0, 1.1), _decode(131071, 81.0, 1.0)],
              "prefill": [_prefill(1024, 10.0), _prefill(4096, 52.0), _prefill(8192, 50.0)]}
    lines = report.check_targets(result)
    assert lines[0].startswith("decode, context >= 32k: worst 81.0% of copy bandwidth") and lines[0].endswith(": MET")
    assert "worst SDPA/paged time ratio 1.00" in lines[1] and lines[1].endswith(": MET")  # short contexts ignored
    assert lines[2].startswith("prefill, chunks >= 4k: worst 50.0%") and lines[2].endswith(": MET")

    result["decode"][2]["sdpa_over_paged"] = 0.99
    result["prefill"][1]["pct_matmul"] = 49.9
    lines = report.check_targets(result)
    assert lines[1].endswith("NOT MET") and lines[2].endswith("NOT MET") and lines[0].endswith(": MET")


def test_an_option_is_judged_only_on_every_case_and_marked_not_the_default():
    rows = [_decode(32767, 70.0, 0.9, prefetch_ms=0.2, prefetch_speedup=1.25, sdpa_over_prefetch=1.1),
            _decode(65535, 75.0, 0.95, prefetch_ms=0.2, prefetch_speedup=1.1, sdpa_over_prefetch=1.05)]
    lines = report.check_targets({"decode": rows, "prefill": []})
    option = [line for line in lines if "prefetch_ids" in line]
    assert option == ["decode, context >= 32k, with prefetch_ids: worst 82.5% of copy bandwidth, worst SDPA/paged 1.05 "
                      "(both targets MET; not the default)"]
    del rows[1]["prefetch_ms"]  # timed on one case only: no verdict for the option
    assert not [line for line in report.check_targets({"decode": rows, "prefill": []}) if "prefetch_ids" in line]


@pytest.mark.parametrize("result", [{"decode": [], "prefill": []},
                                    {"decode": [_decode(4096, 90.0, 2.0)], "prefill": [_prefill(2048, 60.0)]}])
def test_no_verdict_without_a_case_large_enough(result):
    assert report.check_targets(result) == ["no case large enough to judge the targets was run"]


def test_the_markdown_names_the_searched_grid_columns():
    result = {"env": {"date": "d", "gpu": "g", "sms": 1, "l2_mib": 1, "torch": "t", "triton": "t", "cuda": "c",
                      "model": "m", "model_dtype": "bf16"},
              "roofs": {"copy_bytes_per_s": 4e12, "matmul_flops": 8e14},
              "decode": [_decode(32767, 85.0, 1.1, search_ms=0.33, decode_only_speedup=1.1)], "prefill": [],
              "targets": ["x"]}
    md = report.markdown(result)
    assert "| searched us | gain |" in md and "| 330.0 | 1.10 |" in md
