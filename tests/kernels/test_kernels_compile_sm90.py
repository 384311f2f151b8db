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
from sm90_compile import VARIANTS, integer_count, key_loops, ptxas_path

pytestmark = pytest.mark.skipif(ptxas_path() is None, reason="Triton's bundled ptxas not found")


@pytest.fixture(scope="module")
def sm90_results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = os.path.join(os.path.dirname(__file__), "sm90_compile.py")
    proc = subprocess.run([sys.executable, script, "--loops"], capture_output=True, text=True, env=env, timeout=300, check=False)
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


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "prefetch" in v or "tma_paged" in v])
def test_prefetched_block_ids_pipeline_the_paged_loads(variant, sm90_results):
    """With block ids loaded a tile ahead, the loop waits for the oldest of num_stages - 1 tiles'
    K/V copies, not for all of them: the gathered loads are pipelined like contiguous ones."""
    res = sm90_results[variant]
    assert res["ok"], res.get("error")
    # TMA copies (tma_paged: each tile's block id from the previous iteration) sit in num_stages - 1 buffers
    depth = res.get("tma_buffers", res["max_groups_in_flight"])
    assert depth >= VARIANTS[variant][5] - 1, res


def test_a_key_loop_starting_at_a_runtime_tile_is_as_lean_as_one_starting_at_zero(sm90_results):
    """Key positions are split into (table entry, slot) by an unsigned shift and mask
    (`_block_and_slot`). With signed division, the split-KV decode loop, which starts at its
    segment's first tile, carried about twice the integer instructions per tile of the loop
    starting at tile 0 (229 against 119 with triton 3.6): the sign fix-up of each division."""
    split = key_loops(sm90_results["attn_decode_split_bf16_w4s2"])
    whole = key_loops(sm90_results["attn_decode_bf16_w4s2"])
    if not split or not whole:
        pytest.skip("nvdisasm not bundled with this Triton: no machine-code loops to compare")
    assert split[0]["mix"].get("HMMA", 0) > 0 and split[0]["mix"].get("LDGSTS", 0) > 0, split[0]  # the key loop
    assert integer_count(split[0]) <= 1.15 * integer_count(whole[0]), (split[0], whole[0])


def test_tma_copies_of_new_kv_tiles_drop_the_per_element_address_arithmetic(sm90_results):
    """tma_new_kv: the unmasked key loop over the step's own K/V (the second key loop of the
    NEW_KV variants) issues bulk tensor copies instead of per-thread async copies, so it keeps no
    LDGSTS and well under the pointer loop's integer instructions (40 against 109 per warp and
    tile with triton 3.6, 63 against 114 with 3.9)."""
    tma = key_loops(sm90_results["attn_prefill_tma_new_kv_bf16_d128"])
    ptr = key_loops(sm90_results["attn_prefill_new_kv_bf16_d128"])
    if not tma or not ptr:
        pytest.skip("nvdisasm not bundled with this Triton: no machine-code loops to compare")
    new_tma, new_ptr = tma[1], ptr[1]
    assert new_tma["mix"].get("HGMMA", 0) == new_ptr["mix"].get("HGMMA", 0) > 0, (new_tma, new_ptr)
    assert new_ptr["mix"].get("LDGSTS", 0) > 0 and new_tma["mix"].get("LDGSTS", 0) == 0, (new_tma, new_ptr)
    assert integer_count(new_tma) <= 0.75 * integer_count(new_ptr), (new_tma, new_ptr)
