"""Compile every kernel variant the launchers pick for sm_90 (no GPU needed; skipped without ptxas).

The interpreter cannot see compiled-mode problems (e.g. a scalar argument equal to 1 becomes a
constexpr, loop-carried type changes); these tests compile the real kernels, in a subprocess with
``TRITON_INTERPRET`` unset, and check that nothing spills and shared memory fits an H100/H200.
"""
import json
import os
import subprocess
import sys

import pytest
from sm90_compile import VARIANTS, ptxas_path

pytestmark = pytest.mark.skipif(ptxas_path() is None, reason="Triton's bundled ptxas not found")


@pytest.fixture(scope="module")
def sm90_results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = os.path.join(os.path.dirname(__file__), "sm90_compile.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=300, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("SM90_RESULTS="):
            return json.loads(line.split("=", 1)[1])
    pytest.fail(f"compile subprocess failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_compiles_for_sm90(variant, sm90_results):
    res = sm90_results[variant]
    assert res["ok"], res.get("error")
    assert res["shared"] <= 227 * 1024, res
    assert res.get("spill_bytes", 0) == 0, res


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "prefetch" in v])
def test_prefetched_block_ids_pipeline_the_paged_loads(variant, sm90_results):
    """With block ids loaded a tile ahead, the loop waits for the oldest of num_stages - 1 tiles'
    K/V copies, not for all of them: the gathered loads are pipelined like contiguous ones."""
    res = sm90_results[variant]
    assert res["ok"], res.get("error")
    assert res["max_groups_in_flight"] >= VARIANTS[variant][5] - 1, res
