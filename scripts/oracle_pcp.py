"""Check that vLLM 0.33's scheduler schedules the same with prefill context parallelism (a
development aid, like the other oracle scripts; run it with the vLLM oracle's venv).

vLLM builds the scheduler's KV-cache manager with pcp_world_size=1, so a PCP engine's steps,
preemptions and prefix hits should be those of the same engine without PCP: simkv replays PCP on
its unchanged engine core (docs/semantics.md). This drives the oracle (../shared/tools/vllm_oracle)
twice on one trace, once with the parallel config's prefill_context_parallel_size set to PCP
before the scheduler is built, and compares the two runs' step and request files byte for byte.

    /tmp/vllm-oracle-venv/bin/python scripts/oracle_pcp.py --pcp 2 --workdir /tmp/oracle_pcp \\
        -- --input traces/req400_prefix10.parquet --block-size 16 --num-gpu-blocks 3000 \\
        --max-num-seqs 256 --max-num-batched-tokens 2048 --max-model-len 4096
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORACLE = ROOT.parent / "shared" / "tools" / "vllm_oracle" / "oracle.py"

_RUN = """
import runpy, sys
from vllm.v1.core.sched import scheduler as module

pcp = int(sys.argv.pop(1))
build = module.Scheduler.__init__

def with_pcp(self, vllm_config, *args, **kwargs):
    vllm_config.parallel_config.prefill_context_parallel_size = pcp
    build(self, vllm_config, *args, **kwargs)
    assert self.pcp_world_size == pcp

module.Scheduler.__init__ = with_pcp
sys.argv[0] = {oracle!r}
runpy.run_path({oracle!r}, run_name="__main__")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pcp", type=int, default=2)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("oracle_args", nargs=argparse.REMAINDER, help="after --: oracle.py run's options")
    args = parser.parse_args()
    rest = [a for a in args.oracle_args if a != "--"]
    args.workdir.mkdir(parents=True, exist_ok=True)
    runner = args.workdir / "run_with_pcp.py"
    runner.write_text(_RUN.format(oracle=str(ORACLE)))
    for pcp in (1, args.pcp):
        subprocess.run([sys.executable, str(runner), str(pcp), "run", *rest,
                        "--out-prefix", str(args.workdir / f"pcp{pcp}")], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
    same = True
    for suffix in ("steps.csv", "requests.csv"):
        a, b = args.workdir / f"pcp1.{suffix}", args.workdir / f"pcp{args.pcp}.{suffix}"
        equal = filecmp.cmp(a, b, shallow=False)
        same &= equal
        print(f"{suffix}: {'the same' if equal else 'DIFFERENT'} ({sum(1 for _ in open(a)) - 1} rows)")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
