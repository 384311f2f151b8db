"""The host link's copy rates, measured: what simkv's `--pcie-bandwidth-gbs` (63 GB/s by default,
PCIe Gen5 x16) stands for.

simkv prices every transfer between host and GPU memory at that one rate: swapping, the CPU tier
of KV offloading, weights in host memory (`--cpu-offload-gb`, `--offload-group-size`) and LoRA
adapters copied into their slots. On a CUDA host this times copies of pinned host memory to the
GPU and back (and of pageable memory to the GPU) with CUDA events, the median of `--repeats`
copies of each size, and prints each rate beside simkv's default. `--smoke` times host-to-host
copies instead (any machine; it checks the script, not a link).

    python bench/host_link.py [--sizes-mib 64,256,1024] [--repeats 5] [--out FILE]
    python bench/host_link.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_GBS = 63.0  # simkv's CacheConfig.pcie_bandwidth_gbs


def _cuda_copy_s(dst, src, repeats: int) -> float:
    import torch

    dst.copy_(src, non_blocking=True)  # (warm-up)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _host_copy_s(dst, src, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure(sizes_mib: list[int], repeats: int, smoke: bool) -> list[dict]:
    """One row per size and direction: bytes, seconds, GB/s."""
    import torch

    rows = []
    for mib in sizes_mib:
        n = mib << 20
        if smoke:
            a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
            cases = [("host to host (smoke)", lambda: _host_copy_s(b, a, repeats))]
        else:
            pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            pageable = torch.empty(n, dtype=torch.uint8)
            device = torch.empty(n, dtype=torch.uint8, device="cuda")
            cases = [("pinned host to GPU", lambda: _cuda_copy_s(device, pinned, repeats)),
                     ("GPU to pinned host", lambda: _cuda_copy_s(pinned, device, repeats)),
                     ("pageable host to GPU", lambda: _cuda_copy_s(device, pageable, repeats))]
        for name, run in cases:
            seconds = run()
            rows.append({"direction": name, "bytes": n, "seconds": seconds, "gbs": n / seconds / 1e9})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="host-to-host copies of small sizes (any machine)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    a = ap.parse_args(argv)
    import torch

    smoke = a.smoke
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script", file=sys.stderr)
        return 2
    sizes = [int(x) for x in a.sizes_mib.split(",")] if not smoke else [1, 4]
    device = "host (smoke)" if smoke else torch.cuda.get_device_name(0)
    rows = measure(sizes, a.repeats, smoke)
    print(f"Host link on {device} (simkv's --pcie-bandwidth-gbs default: {DEFAULT_GBS:g} GB/s):")
    print("| copy | MiB | ms | GB/s | / simkv's default |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['direction']} | {r['bytes'] >> 20:,} | {r['seconds'] * 1e3:.2f} | {r['gbs']:.1f} "
              f"| {r['gbs'] / DEFAULT_GBS:.2f} |")
    if a.out is not None:
        tmp = a.out.with_suffix(a.out.suffix + ".tmp")
        tmp.write_text(json.dumps({"device": device, "smoke": smoke, "default_gbs": DEFAULT_GBS, "rows": rows},
                                  indent=1))
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
