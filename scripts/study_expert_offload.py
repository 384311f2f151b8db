"""The expert-offloading rows of docs/studies.md's weight-offloading study, regenerated:
DeepSeek-V3 (FP8, 673 GB of weights, 97 % routed experts) does not fit 8 H100s; with part of
each GPU's routed experts in host memory it does, vLLM's UVA way (`--cpu-offload-gb 30
--cpu-offload-params experts`: a step reads the experts it routes to over the host link) or its
prefetch way (`--offload-group-size 4 --offload-num-in-group 2 --offload-params experts`: half
the expert layers' experts copied in whole every pass), over PCIe Gen5 or a 450 GB/s link,
against 8 H200s that hold everything; the first 400 requests of the bundled Azure slice at its
own rate, roofline. Prints one markdown row per replay.

    .venv/bin/python scripts/study_expert_offload.py
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from study_runs import AZURE, SIMKV, replay_summary  # (scripts/ is on sys.path when run as a script)

DS = ["--model", "deepseek-v3", "-tp", "8"]
SETUPS = [("8 H200s, all weights on the GPUs", DS + ["--gpu", "H200"])]
for link in (63, 450):
    SETUPS += [
        (f"8 H100s, UVA: 30 GiB of experts a GPU, {link} GB/s",
         DS + ["--gpu", "H100-SXM", "--cpu-offload-gb", "30", "--cpu-offload-params", "experts",
               "--pcie-bandwidth-gbs", str(link)]),
        (f"8 H100s, UVA: 30 GiB of any weights a GPU, {link} GB/s",
         DS + ["--gpu", "H100-SXM", "--cpu-offload-gb", "30", "--pcie-bandwidth-gbs", str(link)]),
        (f"8 H100s, prefetch: experts of 2 in 4 layers, {link} GB/s",
         DS + ["--gpu", "H100-SXM", "--offload-group-size", "4", "--offload-num-in-group", "2",
               "--offload-params", "experts", "--pcie-bandwidth-gbs", str(link)]),
    ]


def main() -> None:
    print("| setup | KV blocks | TPOT p50 ms | TTFT p50 / p99 s | req/s | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "az400.parquet"
        subprocess.run(SIMKV + ["trace", "transform", str(AZURE), "--head", "400", "--out", str(trace)],
                       check=True, capture_output=True)
        for name, options in SETUPS:
            s = replay_summary(trace, options, Path(tmp))
            print(f"| {name} | {s['num_gpu_blocks']:,} | {1e3 * s['tpot_s']['p50']:.1f} | "
                  f"{s['ttft_s']['p50']:.2f} / {s['ttft_s']['p99']:.2f} | {s['request_throughput_req_s']:.2f} | "
                  f"{s['output_throughput_tok_s']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
