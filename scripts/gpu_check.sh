#!/usr/bin/env bash
# GPU check of the paged-attention kernels: CUDA kernel tests + benchmark, in ~8 minutes.
#
#   bash scripts/gpu_check.sh OUTDIR [BUNDLE_DIR]
#
# With BUNDLE_DIR (e.g. the device tool's $OUT, which returns at most 8 files): at the end,
# BUNDLE_DIR gets summary.md plus gpu_check.tgz holding all of OUTDIR (logs, bench JSON,
# calib.json, the replays' summary.json / measured_steps.parquet / steps.parquet, compare.md):
#   bash scripts/gpu_check.sh /tmp/gc "$OUT"
#
# Needs only torch + triton (+ pytest if present; otherwise a standalone checker runs) on a
# CUDA host; no network, no simulator dependencies.  Every step is time-bounded and a failing
# step is recorded, not fatal.  Writes OUTDIR/summary.md plus raw logs, JUnit XML and the
# benchmark's JSON/CSV/markdown.  Paste the tables of summary.md into reports/kernels.md.
set -euo pipefail
OUT="${1:?usage: bash scripts/gpu_check.sh OUTDIR   (GPU_CHECK_MODE=all|kernels|loop, default all)}"
# all (default): kernel tests + a short benchmark + the gpu_backend loop, about 8.5 minutes in all, to
#                fit one 10-minute device command; kernels / loop: one part with its full budget.
MODE="${GPU_CHECK_MODE:-all}"
MODEL="${GPU_CHECK_MODEL:-llama-3-8b}"   # the GPU-backend parts; tiny-llama + GPU_LOOP_ARGS="--device cpu" smoke-tests them on CPU
BUNDLE="${2:-}"
case "$MODE" in all|kernels|loop) ;; *) echo "GPU_CHECK_MODE must be all, kernels or loop" >&2; exit 2;; esac
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, triton" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/simkv-triton-cache}"   # tests and bench share compiled kernels
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
unset TRITON_INTERPRET
START=$(date +%s)
# The whole command must end inside the device's 10-minute limit: the parts below size
# themselves from what is left of GPU_CHECK_TOTAL_S (default 570 s).
TOTAL_S="${GPU_CHECK_TOTAL_S:-570}"
left_s() { echo $(( TOTAL_S - ($(date +%s) - START) )); }
bundle() {  # refresh BUNDLE (if given) with summary.md and a tarball of OUT: what exists so far comes back
    [ -n "$BUNDLE" ] || return 0
    mkdir -p "$BUNDLE"
    cp "$OUT/summary.md" "$BUNDLE/" 2>/dev/null || true
    tar czf "$BUNDLE/gpu_check.tgz.tmp" -C "$(dirname "$OUT")" "$(basename "$OUT")" 2>/dev/null \
        && mv "$BUNDLE/gpu_check.tgz.tmp" "$BUNDLE/gpu_check.tgz" && echo "bundled into $BUNDLE/gpu_check.tgz"
}

# The GPU host has no simpy (and maybe no rich): both are pure Python; their py3-none-any wheels are
# committed in scripts/gpu_wheels/ (see the gpu_backend loop section below); SITE is where they go.
SITE=/tmp/site
install_wheels() {
    if ! $PY -c "import simpy, rich" 2>/dev/null; then
        if ls scripts/gpu_wheels/*.whl >/dev/null 2>&1; then
            $PY -m pip install -q --no-deps --no-index --target "$SITE" scripts/gpu_wheels/*.whl >"$OUT/wheels.log" 2>&1 \
                || { echo "pip --target failed; importing the wheels as zips" >>"$OUT/wheels.log"; SITE="$(ls -d "$PWD"/scripts/gpu_wheels/*.whl | paste -sd:)"; }
        else
            echo "   -> simpy/rich missing and no scripts/gpu_wheels/: the GPU-backend parts will fail" | tee "$OUT/wheels.log"
        fi
    fi
}
install_wheels

step() {  # step NAME SECONDS CMD...  -> runs CMD with a timeout, logs to OUT/NAME.log, records its status
    local name="$1" secs="$2"; shift 2
    local t0=$(date +%s) rc=0
    echo "== $name (limit ${secs}s): $*"
    timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    local last; last="$(grep -E '[0-9]+ (passed|failed)|skipped|Error' "$OUT/$name.log" | tail -n 1 | cut -c1-200 || true)"
    echo "exit $rc after $(( $(date +%s) - t0 ))s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')${last:+; $last}" >"$OUT/$name.status"
    echo "   -> $name: $(cat "$OUT/$name.status")"
}

if [ "$MODE" != loop ]; then
TEST_LIMIT=$([ "$MODE" = all ] && echo 180 || echo 240)
step env 60 bash -c "date -u; nvidia-smi || true; $PY -c 'import sys, torch, triton; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"NO CUDA DEVICE\")'"

if $PY -c "import pytest" 2>/dev/null; then
    # three shards in parallel: kernel compilation (CPU-bound) dominates the test time
    PYTEST=($PY -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels --continue-on-collection-errors -rfEs -o addopts="")
    step tests_attention "$TEST_LIMIT" "${PYTEST[@]}" tests/kernels/test_kernels_paged_attention.py --junitxml="$OUT/tests_attention.xml" &
    step tests_cuda "$TEST_LIMIT" "${PYTEST[@]}" tests/kernels/test_kernels_cuda.py --junitxml="$OUT/tests_cuda.xml" &
    step tests_other "$TEST_LIMIT" "${PYTEST[@]}" tests/kernels -k "not sm90" --ignore=tests/kernels/test_kernels_paged_attention.py \
        --ignore=tests/kernels/test_kernels_cuda.py --junitxml="$OUT/tests_other.xml" &
    # the GPU backend's own CUDA tests (CUDA vs CPU logits, fused vs unfused ops, captured decode and
    # piecewise graphs vs the eager forward), alongside: they compile kernels too
    if [ "${GPU_CHECK_SKIP_LOOP:-0}" != 1 ]; then
        PYTHONPATH="$SITE:$PYTHONPATH" step tests_gpu_backend "$TEST_LIMIT" $PY -m pytest -q -p no:cacheprovider -o addopts="" \
            --continue-on-collection-errors -m cuda tests/gpu_backend --junitxml="$OUT/tests_gpu_backend.xml" &
    fi
    wait
else
    step tests_standalone 300 $PY tests/kernels/standalone_check.py --device cuda --json "$OUT/tests_standalone.json"
fi

ELAPSED=$(( $(date +%s) - START ))
BUDGET=$(( 400 - ELAPSED ))            # keep the whole run under ~8 minutes
if [ "$MODE" = all ]; then BUDGET=$(( 200 - ELAPSED )); fi   # leave ~6 minutes for the loop (and the step benchmark)
if [ "$BUDGET" -lt 60 ]; then BUDGET=60; fi
BENCH_ARGS=(--out "$OUT/bench" --budget "$BUDGET")
# TMA tile copies are swept (and so may be adopted for every later launch) only once this host's CUDA
# tests of them passed: a fault in one would poison the CUDA context of the step benchmark and the loop
TMA_OK=$($PY - "$OUT" <<'PYEOF' 2>/dev/null || echo no
import glob, sys, xml.etree.ElementTree as ET
cases = [c for f in glob.glob(sys.argv[1] + "/tests_*.xml") for c in ET.parse(f).iter("testcase")
         if "tma" in c.get("name", "").lower()]
bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
ran_on_cuda = [c for c in cases if c.find("skipped") is None and ("cuda" in c.get("name", "") or "cuda" in c.get("classname", ""))]
print("yes" if ran_on_cuda and not bad else "no")
PYEOF
)
if [ "$TMA_OK" != yes ]; then BENCH_ARGS+=(--no-tma); echo "   -> TMA configs left out of the sweep (their CUDA tests did not all pass)"; fi
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then BENCH_ARGS+=(--dry-run); fi   # CPU smoke test of this script
step bench $(( BUDGET + 60 )) $PY bench/kernels.py "${BENCH_ARGS[@]}"
# the sweep's fastest tiles (bench/kernel_tuning.py) for every later launch of this run: the step
# benchmark, the calibration and the measured replay (GPU_CHECK_TUNING=0 keeps the heuristic)
TUNING_LINE="kernel tiles: the launcher's heuristic"
if [ "${GPU_CHECK_TUNING:-1}" != 0 ] && [ -f "$OUT/bench/kernel_tuning.json" ]; then
    export SIMKV_KERNEL_TUNING="$OUT/bench/kernel_tuning.json"
    TUNING_LINE="kernel tiles: the benchmark's sweep (bench/kernel_tuning.json) for the steps after it"
fi
echo "   -> $TUNING_LINE"

{
    echo "# simkv kernel GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'))"
    echo
    echo '```'
    grep -E "torch|NVIDIA|H[0-9]+|NO CUDA" "$OUT/env.log" | grep -v "^|" | head -n 4 || true
    echo '```'
    echo
    echo "## Steps"
    echo
    for f in "$OUT"/*.status; do echo "- **$(basename "$f" .status)**: $(cat "$f")"; done
    echo "- $TUNING_LINE"
    echo
    echo "## Test failures (if any)"
    echo
    echo '```'
    grep -hE "^(FAILED|ERROR)|^FAIL " "$OUT"/tests_*.log 2>/dev/null | head -n 40 || true
    echo '```'
    echo
    if [ -f "$OUT/bench/bench.md" ]; then sed 's/^# /## /' "$OUT/bench/bench.md"; else echo "Benchmark produced no report; see bench.log."; tail -n 30 "$OUT/bench.log" 2>/dev/null | sed 's/^/    /'; fi
    echo
    echo "Total time: $(( $(date +%s) - START ))s"
} >"$OUT/summary.md"
echo "wrote $OUT/summary.md"
bundle
fi  # MODE != loop

# >>>>>>>>>> gpu_backend loop (GPU BACKEND issue; owner: gpu_backend/, simkv/calibration, simkv/compare) >>>>>>>>>>
# The full loop for llama-3-8b in bf16, bounded to at most 9 minutes on its own:
#   calibrate within a fixed budget -> replay a trace slice on the GPU backend -> replay it simulated
#   with the fitted calib.json -> compare (targets: duration/throughput 3 %, TTFT/ITL p50 5 %, p99 10 %).
# Results: OUTDIR/gpu_loop/ (loop_summary.md, calib.json, measured/, sim/, compare/). Copy that folder to
# reports/gpu/<YYYY-MM-DD>_<GPU>/ and commit it (reports/gpu/README.md).
# Skip it with GPU_CHECK_SKIP_LOOP=1. To run ONLY the loop (the kernel part above takes ~8 minutes):
#   PYTHONPATH=$PWD:/tmp/site python3 -m gpu_backend.loop OUTDIR/gpu_loop --total-s 520
# after installing the wheels as below.
# The GPU host has no simpy (and maybe no rich): both are pure Python; their py3-none-any wheels are
# committed in scripts/gpu_wheels/ (1.7 MB), made on a networked machine with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d scripts/gpu_wheels simpy==4.1.2 rich markdown-it-py mdurl pygments
# and installed there with `pip install --no-deps --no-index --target /tmp/site scripts/gpu_wheels/*.whl` + PYTHONPATH.
gpu_backend_loop() {
    local out="$1/gpu_loop"
    mkdir -p "$out"
    # each process of the loop stops capturing piecewise graphs after this long (the largest size and
    # the powers of two first; later steps pad to a coarser size): captures must not eat the replays
    export SIMKV_GRAPH_CAPTURE_BUDGET_S="${SIMKV_GRAPH_CAPTURE_BUDGET_S:-$([ "$MODE" = all ] && echo 30 || echo 90)}"
    local site="$SITE"   # the wheels, installed at the start (install_wheels)
    # this host's Python time in our kernel wrappers per call, one-call vs planned (no GPU work; seconds)
    step launch_overhead 40 $PY bench/launch_overhead.py --calls 1000 --rounds 3
    { echo; echo '```'; cat "$OUT/launch_overhead.log"; echo '```'; } >>"$OUT/summary.md"
    # the host link's copy rates (bench/host_link.py): what --pcie-bandwidth-gbs stands for in swapping,
    # the CPU tier, weights in host memory and LoRA copies (a few seconds)
    step host_link 30 $PY bench/host_link.py --sizes-mib 64,1024 --repeats 5 --out "$OUT/host_link.json"
    { echo; grep -E '^(Host|\|)' "$OUT/host_link.log" || echo "host_link: no table (see host_link.log)"; } >>"$OUT/summary.md"
    # this host's time to build a step's input arrays and stage a decode graph's buffers (seconds)
    PYTHONPATH="$site:$PYTHONPATH" step step_inputs 40 $PY bench/step_inputs.py --rounds 3
    { echo; echo "Step inputs on this host (bench/step_inputs.py):"; echo; grep '^|' "$OUT/step_inputs.log"; } >>"$OUT/summary.md"
    # step time eager vs decode CUDA graphs, fused vs unfused element-wise ops, and the host's share (bench/gpu_step.py)
    # only with time to spare: the loop (the GPU backend's targets) keeps 250 s + 30 s to bundle in all mode
    local keep=$([ "$MODE" = all ] && echo 280 || echo 400)
    local spare=$(( $(left_s) - keep ))
    if [ "$spare" -gt 100 ]; then spare=100; fi
    if [ "$spare" -ge 60 ]; then
        PYTHONPATH="$site:$PYTHONPATH" step gpu_step "$spare" $PY bench/gpu_step.py --model "$MODEL" --out "$OUT/gpu_step" \
            --budget-s $(( spare - 40 ))
        { echo; cat "$OUT/gpu_step/gpu_step.md" 2>/dev/null || echo "gpu_step: no report (see gpu_step.log)"; } >>"$OUT/summary.md"
    else
        echo "- gpu_step skipped: $(left_s)s left, and the loop keeps ${keep}s" >>"$OUT/summary.md"
    fi
    # the vision encoder (Qwen2.5-VL-7B's ViT, random weights) against simkv's roofline of it
    # (bench/vision_encoder.py): the images' time in every replay; only with time to spare
    if [ $(( $(left_s) - keep )) -ge 45 ]; then
        PYTHONPATH="$site:$PYTHONPATH" step vision_encoder 40 $PY bench/vision_encoder.py --device cuda --repeats 3 \
            --out "$OUT/vision_encoder.json"
        { echo; echo "Vision encoder (bench/vision_encoder.py):"; echo; grep '^|' "$OUT/vision_encoder.log" \
            || echo "no table (see vision_encoder.log)"; } >>"$OUT/summary.md"
    else
        echo "- vision_encoder skipped: $(left_s)s left, and the loop keeps ${keep}s" >>"$OUT/summary.md"
    fi
    # the GPU backend's own CUDA tests, unless they ran beside the kernel tests
    if [ ! -f "$OUT/tests_gpu_backend.status" ] && $PY -c "import pytest" 2>/dev/null && [ "$(left_s)" -gt 300 ]; then
        PYTHONPATH="$site:$PYTHONPATH" step tests_gpu_backend 120 $PY -m pytest -q -p no:cacheprovider -o addopts="" \
            --continue-on-collection-errors -m cuda tests/gpu_backend --junitxml="$OUT/tests_gpu_backend.xml"
        echo "- **tests_gpu_backend**: $(cat "$OUT/tests_gpu_backend.status")" >>"$OUT/summary.md"
    fi
    local total=$([ "$MODE" = all ] && echo 250 || echo 520)
    local room=$(( $(left_s) - 30 ))   # leave time to bundle
    if [ "$total" -gt "$room" ]; then total=$room; fi
    if [ "$total" -lt 60 ]; then echo "   -> gpu_backend loop skipped: ${room}s left" | tee -a "$OUT/summary.md"; return 0; fi
    # a second calibration from the measured steps of the next requests (run only if time is left)
    local train=$([ "$MODE" = all ] && echo 150 || echo 400)
    # CUDA graphs of the loop's calibration and measured replays: vLLM's default (decode steps from
    # full graphs, steps with prefill chunks from piecewise ones) once this host's CUDA test of the
    # piecewise graphs passed, else decode graphs only; GPU_CHECK_CUDAGRAPH_MODE forces one
    local mode="${GPU_CHECK_CUDAGRAPH_MODE:-}"
    if [ -z "$mode" ]; then
        mode=$($PY - "$OUT/tests_gpu_backend.xml" <<'PYEOF' 2>/dev/null || echo full_decode_only
import sys, xml.etree.ElementTree as ET
case = [c for c in ET.parse(sys.argv[1]).iter("testcase") if c.get("name") == "test_captured_piecewise_graphs_match_eager_forward"]
print("full_and_piecewise" if case and len(list(case[0])) == 0 else "full_decode_only")
PYEOF
)
    fi
    echo "   -> loop CUDA graphs: $mode"
    PYTHONPATH="$site:$PYTHONPATH" step gpu_backend_loop $(( total + 20 )) $PY -m gpu_backend.loop "$out" --model "$MODEL" \
        --total-s "$total" --train-requests "$train" --cudagraph-mode "$mode" ${GPU_LOOP_ARGS:-}
    cat "$out/loop_summary.md" 2>/dev/null >>"$OUT/summary.md" || true
}
if [ "${GPU_CHECK_SKIP_LOOP:-0}" != 1 ] && [ "$MODE" != kernels ]; then
    gpu_backend_loop "$OUT" || true
    echo "wrote $OUT/gpu_loop/loop_summary.md"
fi
# <<<<<<<<<< gpu_backend loop <<<<<<<<<<

bundle
