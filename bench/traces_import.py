"""Benchmark of trace import: time and peak memory (RSS) of importing a large CSV, and the Mooncake file.

    .venv/bin/python bench/traces_import.py --rows 1000000            # 1M-row BurstGPT-like CSV
    .venv/bin/python bench/traces_import.py --mooncake ../shared/traces/mooncake/synthetic_trace.jsonl

Each measurement runs in a fresh child process so that its peak RSS is its own.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_csv(path: Path, rows: int, seed: int = 0) -> None:
    """A BurstGPT-like CSV: Timestamp (s), Model, Request tokens, Response tokens (about 1% zero)."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(0.05, rows))
    prompt = np.clip(rng.lognormal(6.0, 1.0, rows), 1, 32000).astype(np.int64)
    output = np.clip(rng.lognormal(5.0, 1.0, rows), 1, 4000).astype(np.int64)
    output[rng.random(rows) < 0.01] = 0
    with open(path, "w") as handle:
        handle.write("Timestamp,Model,Request tokens,Response tokens,Log Type\n")
        for start in range(0, rows, 100_000):
            end = min(start + 100_000, rows)
            lines = [f"{t:.3f},ChatGPT,{p},{o},Conversation log\n"
                     for t, p, o in zip(times[start:end], prompt[start:end], output[start:end])]
            handle.write("".join(lines))


def child(fmt: str, source: str, out: str) -> None:
    """Runs in the child: import, then print seconds and peak RSS (MiB)."""
    from simkv.traces.importers import ColumnMap, import_to_file

    mapping = ColumnMap("Timestamp", "Request tokens", "Response tokens") if fmt == "csv" else None
    started = time.perf_counter()
    report = import_to_file(fmt, [source], out, mapping=mapping)
    seconds = time.perf_counter() - started
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{fmt}: {report.summary()}")
    print(f"{fmt}: import {seconds:.2f} s, peak RSS {peak_mib:.0f} MiB (whole Python process)")


def measure(fmt: str, source: Path, out: Path) -> None:
    subprocess.run([sys.executable, __file__, "--child", fmt, str(source), str(out)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--mooncake", type=Path)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        if args.mooncake:
            measure("mooncake", args.mooncake, base / "mooncake.parquet")
        if args.rows:
            source = base / "big.csv"
            make_csv(source, args.rows)
            print(f"csv: {args.rows:,} rows, {source.stat().st_size / 2**20:.0f} MiB")
            measure("csv", source, base / "big.parquet")
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import sys; from simkv.traces import read_trace; "
                            "t = read_trace(sys.argv[1]); print(f'read back {len(t):,} rows')",
                            str(base / "big.parquet")], check=True)
            print(f"csv: read_trace of the result {time.perf_counter() - started:.2f} s (incl. interpreter start)")


if __name__ == "__main__":
    main()
