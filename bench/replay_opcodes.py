"""Python bytecodes a replay executes, per function: an exact, drift-free profile.

    .venv/bin/python bench/replay_opcodes.py                 # first 2,000 Azure requests, top 30
    .venv/bin/python bench/replay_opcodes.py --requests 500 --top 50

`sys.settrace` with opcode events counts every bytecode instruction each function executes
(C code such as heapq or numpy counts as the one call instruction that reaches it). Unlike
wall-clock profilers on this VM the counts do not drift and do not depend on how small a
function is, so they say where the interpreter's work goes; `bench/replay_instructions.py`
gives the machine-instruction total that includes C code. Tracing slows the replay about 20x.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
AZURE = ROOT.parent / "shared" / "traces" / "azure" / "AzureLLMInferenceTrace_conv.csv"


def count_opcodes(trace, config) -> collections.Counter:
    from simkv.replay.api import replay

    counts: collections.Counter = collections.Counter()

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        key = (str(Path(frame.f_code.co_filename)).replace(str(ROOT) + "/", ""), frame.f_code.co_name)

        def local(frame, event, arg):
            if event == "opcode":
                counts[key] += 1
            return local

        return local

    sys.settrace(tracer)
    try:
        replay(trace, config)
    finally:
        sys.settrace(None)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="replay the first N Azure requests")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    import numpy as np

    from simkv.config import EngineConfig
    from simkv.traces.importers import import_trace
    from simkv.traces.schema import take_rows

    trace = import_trace("azure", [str(AZURE)])[0]
    trace = take_rows(trace, np.arange(min(args.requests, len(trace))))
    counts = count_opcodes(trace, EngineConfig())
    total = sum(counts.values())
    print(f"first {len(trace)} Azure requests: {total:,} bytecodes")
    print("| bytecodes | share | function |\n|---:|---:|---|")
    for (path, name), n in counts.most_common(args.top):
        print(f"| {n:,} | {100 * n / total:.1f} % | `{path}:{name}` |")


if __name__ == "__main__":
    main()
