"""Instructions executed by a replay, counted by valgrind: a speed measure that does not drift.

This VM's wall-clock speed drifts by 25-50 % over minutes, which hides changes of a few percent.
The number of machine instructions a replay executes does not drift: run it before and after a
change to compare code versions.

    .venv/bin/python bench/replay_instructions.py              # first 2,000 Azure requests
    .venv/bin/python bench/replay_instructions.py --requests 5000 --tree /path/to/other/checkout
    .venv/bin/python bench/replay_instructions.py --double steps_to_reach   # one function's share

It runs `valgrind --tool=cachegrind --cache-sim=no` twice: once replaying the first N requests of
the Azure 2023 conversation trace (roofline, default engine) and once stopping before the replay
(imports and trace loading only), with PYTHONHASHSEED=0 and single-threaded numpy and Arrow. The
difference is the replay's count. Each count takes about a minute for 2,000 requests.

`--double NAME` calls one side-effect-free function twice wherever the replay calls it once (the
logging functions into a scratch log) and prints its share: the extra instructions over the
replay's. Profilers are unreliable for this on this VM (see docs/performance.md).
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
double = {double!r}
if double:
    import simkv.backends.roofline as R, simkv.core.kv_cache_manager as K, simkv.core.steady_decoders as SD
    import simkv.replay.engine as E, simkv.replay.step_log as L
    cls, name, scratch = {{
        "steps_to_reach": (E, "steps_to_reach", None),  # a function the engine module imported
        "decode_step_line": (R.RooflineCostModel, "decode_step_line", None),
        "decode_run_limit": (SD.SteadyDecoders, "decode_run_limit", None),
        "execute": (R.RooflineCostModel, "execute", None),
        "get_computed_blocks": (K.KVCacheManager, "get_computed_blocks", None),
        "add_run": (L.StepLog, "add_run", L.StepLog),
        "add_step": (L.StepLog, "add_step", L.StepLog),
    }}[double]
    once = getattr(cls, name)
    if cls is E:
        def twice(*args, once=once):
            once(*args)
            return once(*args)
    else:
        def twice(self, *args, once=once, scratch=scratch):
            once(scratch() if scratch else self, *args)
            return once(self, *args)
    setattr(cls, name, twice)
trace = import_trace("azure", [{azure!r}])[0]
n = {n}
if n:
    replay(take_rows(trace, np.arange(min(n, len(trace)))), EngineConfig())
"""


DOUBLES = ("steps_to_reach", "decode_step_line", "decode_run_limit", "execute", "get_computed_blocks", "add_run",
           "add_step")


def count(tree: Path, n: int, double: str = "") -> int:
    # One thread everywhere: idle pool threads that spin would add instructions at random.
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    out = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, "-c", CHILD.format(tree=str(tree), azure=str(AZURE), n=n, double=double)],
        capture_output=True, text=True, env=env)
    match = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if out.returncode or not match:
        raise SystemExit(f"valgrind run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="replay the first N requests")
    parser.add_argument("--tree", type=Path, default=ROOT, help="checkout whose simkv to measure")
    parser.add_argument("--double", choices=DOUBLES, help="also measure this function's share")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed here")
    total = count(args.tree, args.requests)
    base = count(args.tree, 0)
    replay = total - base
    print(f"{args.tree}: replaying the first {args.requests} Azure requests executes "
          f"{replay / 1e6:,.0f} M instructions")
    if args.double:
        extra = count(args.tree, args.requests, args.double) - total
        print(f"{args.double}: {extra / 1e6:,.0f} M instructions, {100 * extra / replay:.1f} % of the replay")


if __name__ == "__main__":
    main()
