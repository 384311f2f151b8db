"""Instructions executed by a replay, counted by valgrind: a speed measure that does not drift.

This VM's wall-clock speed drifts by 25-50 % over minutes, which hides changes of a few percent.
The number of machine instructions a replay executes does not drift: run it before and after a
change to compare code versions.

    .venv/bin/python bench/replay_instructions.py              # first 2,000 Azure requests
    .venv/bin/python bench/replay_instructions.py --requests 5000 --tree /path/to/other/checkout

It runs `valgrind --tool=cachegrind --cache-sim=no` twice: once replaying the first N requests of
the Azure 2023 conversation trace (roofline, default engine) and once stopping before the replay
(imports and trace loading only), with PYTHONHASHSEED=0 and single-threaded numpy and Arrow. The
difference is the replay's count. Each count takes about a minute for 2,000 requests.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AZURE = ROOT.parent / "shared" / "traces" / "azure" / "AzureLLMInferenceTrace_conv.csv"

CHILD = """
import sys
sys.path.insert(0, {tree!r})
import pyarrow
pyarrow.set_cpu_count(1)
pyarrow.set_io_thread_count(1)
import numpy as np
from simkv.config import EngineConfig
from simkv.replay.api import replay
from simkv.traces.importers import import_trace
from simkv.traces.schema import take_rows
trace = import_trace("azure", [{azure!r}])[0]
n = {n}
if n:
    replay(take_rows(trace, np.arange(min(n, len(trace)))), EngineConfig())
"""


def count(tree: Path, n: int) -> int:
    # One thread everywhere: idle pool threads that spin would add instructions at random.
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    out = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, "-c", CHILD.format(tree=str(tree), azure=str(AZURE), n=n)],
        capture_output=True, text=True, env=env)
    match = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if out.returncode or not match:
        raise SystemExit(f"valgrind run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="replay the first N requests")
    parser.add_argument("--tree", type=Path, default=ROOT, help="checkout whose simkv to measure")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed here")
    total = count(args.tree, args.requests)
    base = count(args.tree, 0)
    print(f"{args.tree}: replaying the first {args.requests} Azure requests executes "
          f"{(total - base) / 1e6:,.0f} M instructions")


if __name__ == "__main__":
    main()
