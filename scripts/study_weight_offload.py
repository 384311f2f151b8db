"""The weight-offloading study of docs/studies.md, regenerated: llama-3-70b in fp8 on one H100 with
weights in host memory, vLLM's UVA way (`--cpu-offload-gb`: read over the host link every forward
pass) or its prefetch way (`--offload-group-size`: whole layers copied ahead of their turn), over
PCIe Gen5 or a 450 GB/s link, against a second H100; the bundled Azure slice at a quarter of its
rate, roofline. Prints one markdown row per replay.

    .venv/bin/python scripts/study_weight_offload.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from study_runs import replay_summary, scaled_trace  # (scripts/ is on sys.path when run as a script)

ONE = ["--model", "llama-3-70b", "--quantization", "fp8"]
SETUPS = [("1 H100, fp8, no offload", ONE)]
for link in (63, 450):
    for gib in (10, 20, 40):
        SETUPS.append((f"1 H100, UVA {gib} GiB, {link} GB/s",
                       ONE + ["--cpu-offload-gb", str(gib), "--pcie-bandwidth-gbs", str(link)]))
    for group in (8, 4, 2):  # (10, 20 and 40 of the 80 layers)
        SETUPS.append((f"1 H100, prefetch 1 of {group} layers, {link} GB/s",
                       ONE + ["--offload-group-size", str(group), "--offload-prefetch-step", "2",
                              "--pcie-bandwidth-gbs", str(link)]))
SETUPS += [("2 H100s, TP 2, bf16", ["--model", "llama-3-70b", "-tp", "2"]),
           ("2 H100s, TP 2, fp8", ONE + ["-tp", "2"])]


def main() -> None:
    print("| setup | KV cache tokens | peak / mean running | TPOT p50 ms | TTFT p50 / p99 s | output tok/s "
          "| preemptions |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        trace = scaled_trace(Path(tmp), "0.25")
        for name, options in SETUPS:
            s = replay_summary(trace, options, Path(tmp))
            tokens = s["num_gpu_blocks"] * s["config"]["block_size"]
            print(f"| {name} | {tokens:,} | {s['peak_running']} / {s['mean_running']:.1f} "
                  f"| {s['tpot_s']['p50'] * 1e3:.1f} | {s['ttft_s']['p50']:,.2f} / {s['ttft_s']['p99']:,.2f} "
                  f"| {s['output_throughput_tok_s']:,.0f} | {s['num_preemptions']} |", flush=True)


if __name__ == "__main__":
    main()
