"""Ahead-of-time compilation of the kernels for sm_90 (H100/H200) on a machine without a GPU.

Triton wheels bundle LLVM and ptxas, so the full compiled path (AST -> TTIR -> TTGIR -> LLVM ->
PTX -> cubin) can run on CPU.  This catches errors the interpreter cannot (constexpr-specialized
scalar arguments, loop-carried types, unsupported layouts) and reports registers/spills.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT_ARGS_PTRS = ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "slot_mapping_ptr")


def ptxas_path() -> str | None:
    base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        p = os.path.join(base, name)
        if os.path.exists(p):
            return p
    return None


def compile_sm90(fn, dtype: str, constexprs: dict, *, ones: tuple[str, ...] = (), num_warps: int = 4, num_stages: int = 2):
    """Compile ``fn`` for sm_90 with the given constexprs; int args named in ``ones`` are specialized to 1
    (as Triton does at launch for an argument equal to 1).  Pointers and strides are assumed 16-aligned."""
    sig, attrs, const = {}, {}, dict(constexprs)
    import inspect

    for name, param in inspect.signature(fn.fn).parameters.items():  # constexprs left at their defaults
        if name not in const and param.default is not inspect.Parameter.empty and "constexpr" in str(param.annotation):
            const[name] = param.default
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ones:
            sig[name], const[name] = "constexpr", 1
        elif name.endswith("_ptr"):
            if name.startswith("part"):
                sig[name] = "*fp32"
            elif name in INT_ARGS_PTRS:
                sig[name] = "*i64" if name == "slot_mapping_ptr" else "*i32"
            else:
                sig[name] = "*" + dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def resource_usage(compiled) -> dict:
    """Registers / spill bytes from ``ptxas -v`` plus shared memory from Triton's metadata, and
    how many async-copy groups a wait leaves in flight at most (the depth of load pipelining)."""
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", compiled.asm["ptx"])]
    info = {"shared": compiled.metadata.shared, "max_groups_in_flight": max(waits, default=0)}
    ttgir = compiled.asm.get("ttgir", "")
    if "async_tma_copy_global_to_local" in ttgir:  # TMA copies: the depth of their multi-buffered tiles
        info["tma_buffers"] = max((int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)),
                                  default=1)
    ptxas = ptxas_path()
    if ptxas is None:
        return info
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True, check=False)
    m = re.search(r"Used (\d+) registers", r.stderr)
    s = re.search(r"(\d+) bytes spill stores", r.stderr)
    if m:
        info["registers"] = int(m.group(1))
    if s:
        info["spill_bytes"] = int(s.group(1))
    return info


def sass_loops(compiled) -> list[dict]:
    """The loops of the kernel's sm_90a machine code (``nvdisasm``), each as its length in
    instructions per warp and iteration and its instruction mix (opcode -> count). A loop is the
    span from a branch target back to a branch that jumps to it. Static counts: what one
    iteration issues, not how long it takes; they compare variants of a loop without a GPU."""
    import collections

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        return []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=False).stdout
    instr, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instr)
            continue
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if op:
            instr.append(re.sub(r"^@!?U?P\w+\s+", "", op.group(1).strip()))  # drop the predicate
    loops = []
    for i, ins in enumerate(instr):
        target = re.search(r"BRA.*\((\.L_x_\d+)\)", ins)
        start = labels.get(target.group(1)) if target else None
        if start is not None and start < i:
            body = instr[start:i + 1]
            mix = collections.Counter(b.split()[0].split(".")[0] for b in body)
            loops.append({"instructions": len(body), "mix": dict(mix.most_common())})
    return loops


#: SASS opcodes of integer and address arithmetic (what `--loops` sums as "integer")
INTEGER_OPS = ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "UIADD3", "UMOV", "ISETP", "SEL", "VIADD")


def key_loops(result: dict) -> list[dict]:
    """The key loops of a compiled attention variant (loops of at least 40 instructions: the
    sequence search and empty spins are shorter), unmasked range first."""
    return [loop for loop in result.get("loops", []) if loop["instructions"] >= 40]


def integer_count(loop: dict) -> int:
    return sum(loop["mix"].get(op, 0) for op in INTEGER_OPS)


# name: (kernel, dtype, constexprs, int args specialized to 1, num_warps, num_stages)
VARIANTS = {
    "attn_prefill_fp16_d128": ("attention", "fp16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=64, BLOCK_Q=32,
                                                        BLOCK_M=128, NUM_SEGMENTS=1, DOT_FP32=False, DOT_PREC="tf32"), (), 8, 3),
    "attn_decode_split_bf16_d128": ("attention", "bf16", dict(QPK=8, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=64, BLOCK_Q=2,
                                                             BLOCK_M=16, NUM_SEGMENTS=16, DOT_FP32=False, DOT_PREC="tf32"), (), 8, 3),
    "attn_decode_scalars_eq_1": ("attention", "bf16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=64, BLOCK_Q=4,
                                                          BLOCK_M=16, NUM_SEGMENTS=8, DOT_FP32=False, DOT_PREC="tf32"),
                                 ("num_seqs", "num_heads", "num_kv_heads", "ml_plane", "stride_bt_seq"), 8, 3),
    # the launcher's decode default since the first H200 sweep (4 warps, 2 stages; 24 % faster at 8 x 32k). The
    # sweep's best prefill tile (128 x 32, 4 warps) spills 36 bytes here (triton 3.9), so prefill keeps 128 x 64, 8 warps.
    "attn_decode_bf16_w4s2": ("attention", "bf16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=64, BLOCK_Q=4,
                                                        BLOCK_M=16, NUM_SEGMENTS=1, DOT_FP32=False, DOT_PREC="tf32"), (), 4, 2),
    "attn_decode_split_bf16_w4s2": ("attention", "bf16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=64,
                                                              BLOCK_Q=4, BLOCK_M=16, NUM_SEGMENTS=16, DOT_FP32=False,
                                                              DOT_PREC="tf32"), (), 4, 2),
    # key tiles of new tokens read from the step's K/V instead of the paged cache (bench sweep option)
    "attn_prefill_new_kv_bf16_d128": ("attention", "bf16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=64,
                                                                BLOCK_Q=32, BLOCK_M=128, NUM_SEGMENTS=1, DOT_FP32=False,
                                                                DOT_PREC="tf32", NEW_KV=True), (), 8, 3),
    # new_kv tiles by tensor-descriptor (TMA) copies (config.tma_new_kv)
    "attn_prefill_tma_new_kv_bf16_d128": ("attention", "bf16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16,
                                                                    TILE_N=64, BLOCK_Q=32, BLOCK_M=128, NUM_SEGMENTS=1,
                                                                    DOT_FP32=False, DOT_PREC="tf32", NEW_KV=True,
                                                                    TMA_NEW=True), (), 8, 3),
    # cache tiles by TMA copies, one block a tile (config.tma_paged): the decode candidate
    "attn_decode_tma_paged_bf16_w4s4": ("attention", "bf16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16,
                                                                  TILE_N=16, BLOCK_Q=4, BLOCK_M=16, NUM_SEGMENTS=16,
                                                                  DOT_FP32=False, DOT_PREC="tf32", TMA_PAGED=True), (), 4, 4),
    # block ids loaded a tile ahead (config.prefetch_ids): K/V loads pipeline num_stages - 1 deep
    "attn_prefill_prefetch_bf16_d128": ("attention", "bf16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=64,
                                                                  BLOCK_Q=32, BLOCK_M=128, NUM_SEGMENTS=1, DOT_FP32=False,
                                                                  DOT_PREC="tf32", PREFETCH_IDS=True), (), 8, 3),
    "attn_decode_prefetch_bf16_w4s3": ("attention", "bf16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=64,
                                                                 BLOCK_Q=4, BLOCK_M=16, NUM_SEGMENTS=16, DOT_FP32=False,
                                                                 DOT_PREC="tf32", PREFETCH_IDS=True), (), 4, 3),
    "attn_short_chunks_fp16_d128": ("attention", "fp16", dict(QPK=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=32, TILE_N=64,
                                                             BLOCK_Q=16, BLOCK_M=64, NUM_SEGMENTS=1, DOT_FP32=False,
                                                             DOT_PREC="tf32"), (), 8, 3),
    "attn_mixed_bf16_d80_bs32": ("attention", "bf16", dict(QPK=1, HEAD_SIZE=80, HEAD_PAD=128, BLOCK_SIZE=32, TILE_N=16, BLOCK_Q=64,
                                                          BLOCK_M=64, NUM_SEGMENTS=1, DOT_FP32=False, DOT_PREC="tf32"), (), 4, 3),
    "attn_fp32_ieee_d96": ("attention", "fp32", dict(QPK=3, HEAD_SIZE=96, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=16, BLOCK_Q=10,
                                                    BLOCK_M=32, NUM_SEGMENTS=1, DOT_FP32=True, DOT_PREC="ieee"), (), 8, 2),
    "merge_bf16_d80": ("merge", "bf16", dict(HEAD_SIZE=80, HEAD_PAD=128, NUM_SEGMENTS=16), (), 4, 2),
    "merge_scalars_eq_1": ("merge", "fp16", dict(HEAD_SIZE=128, HEAD_PAD=128, NUM_SEGMENTS=4), ("num_seqs", "num_heads", "ml_plane"), 4, 2),
    "cache_write_fp16": ("cache", "fp16", dict(ROW=1024, HEAD_SIZE=128, BLOCK_SIZE=16, BLOCK_E=1024), (), 4, 2),
    "cache_write_scalars_eq_1": ("cache", "bf16", dict(ROW=80, HEAD_SIZE=80, BLOCK_SIZE=32, BLOCK_E=128),
                                 ("stride_k_head", "stride_v_head"), 1, 2),
    # the element-wise layer ops at llama-3-8b's sizes (kernels/triton_layer_ops.py)
    "rms_norm_add_bf16_h4096": ("rms_norm", "bf16", dict(HIDDEN=4096, BLOCK_H=4096, HAS_RESIDUAL=True), (), 8, 2),
    "rms_norm_bf16_h4096": ("rms_norm", "bf16", dict(HIDDEN=4096, BLOCK_H=4096, HAS_RESIDUAL=False), (), 8, 2),
    "rotary_bf16_d128": ("rotary", "bf16", dict(NUM_ROTATED=40, HALF=64, HALF_PAD=64, HEADS_PER_PROGRAM=8), (), 4, 2),
    "silu_and_mul_bf16": ("silu_and_mul", "bf16", dict(INTER=14336, BLOCK=1024), (), 4, 2),
}


def compile_all(want_loops: bool = False) -> dict:
    """Compile every variant; {name: {"ok": bool, "error"?: str, "registers"?, "spill_bytes"?, "shared"?,
    "loops"? (with `want_loops`: `sass_loops`)}}."""
    from kernels.triton_attention import _merge_segments_kernel, _paged_attention_kernel
    from kernels.triton_cache import _reshape_and_cache_kernel
    from kernels.triton_layer_ops import _rms_norm_kernel, _rotary_kernel, _silu_and_mul_kernel

    kernels = {"attention": _paged_attention_kernel, "merge": _merge_segments_kernel, "cache": _reshape_and_cache_kernel,
               "rms_norm": _rms_norm_kernel, "rotary": _rotary_kernel, "silu_and_mul": _silu_and_mul_kernel}
    results = {}
    for name, (kernel, dtype, const, ones, warps, stages) in VARIANTS.items():
        try:
            compiled = compile_sm90(kernels[kernel], dtype, const, ones=ones, num_warps=warps, num_stages=stages)
            results[name] = {"ok": True, **resource_usage(compiled)}
            if want_loops:
                results[name]["loops"] = sass_loops(compiled)
        except Exception as exc:  # reported per variant by the test
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-2000:]}
    return results


if __name__ == "__main__":
    import json
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    results = compile_all(want_loops="--loops" in sys.argv)
    if "--loops" in sys.argv:
        # per loop of each attention variant: instructions per warp and iteration, and the kinds
        # that dominate (HGMMA/HMMA tensor ops, MUFU exp2, LDGSTS async copies, integer address math)
        kinds = ("HGMMA", "HMMA", "MUFU", "FMUL", "FFMA", "FADD", "LDGSTS", "LDG", "LDS", "LDSM")
        integer = INTEGER_OPS
        print(f"triton {triton.__version__}")
        print("| variant | loop | instructions | " + " | ".join(kinds) + " | integer |\n|---|---:|---:|"
              + "---:|" * (len(kinds) + 1))
        for name, r in results.items():
            if not name.startswith("attn") or not r["ok"]:
                continue
            for j, loop in enumerate(key_loops(r)):
                mix = loop["mix"]
                print(f"| {name} | {j} | {loop['instructions']} | " + " | ".join(str(mix.get(k, 0)) for k in kinds)
                      + f" | {integer_count(loop)} |")
    if "--table" in sys.argv:
        print(f"triton {triton.__version__}")
        print("| variant | warps | stages | registers | spill bytes | shared KiB | copy groups in flight |\n"
              "|---|---:|---:|---:|---:|---:|---:|")
        for name, r in results.items():
            print(f"| {name} | {VARIANTS[name][4]} | {VARIANTS[name][5]} | {r.get('registers', '?')} | "
                  f"{r.get('spill_bytes', '?')} | {r['shared'] / 1024:.1f} | {r['max_groups_in_flight']} |"
                  if r["ok"] else f"| {name} | FAILED: {r['error'][:80]} |||||")
    print("SM90_RESULTS=" + json.dumps(results))
