#!/usr/bin/env bash
# GPU check of the paged-attention kernels: CUDA kernel tests + benchmark, in ~8 minutes.
#
#   bash scripts/gpu_check.sh OUTDIR
#
# Needs only torch + triton (+ pytest if present; otherwise a standalone checker runs) on a
# CUDA host; no network, no simulator dependencies.  Every step is time-bounded and a failing
# step is recorded, not fatal.  Writes OUTDIR/summary.md plus raw logs, JUnit XML and the
# benchmark's JSON/CSV/markdown.  Paste the tables of summary.md into reports/kernels.md.
set -euo pipefail
OUT="${1:?usage: bash scripts/gpu_check.sh OUTDIR}"
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

step() {  # step NAME SECONDS CMD...  -> runs CMD with a timeout, logs to OUT/NAME.log, records its status
    local name="$1" secs="$2"; shift 2
    local t0=$(date +%s) rc=0
    echo "== $name (limit ${secs}s): $*"
    timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    local last; last="$(grep -E '[0-9]+ (passed|failed)|skipped|Error' "$OUT/$name.log" | tail -n 1 | cut -c1-200 || true)"
    echo "exit $rc after $(( $(date +%s) - t0 ))s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')${last:+; $last}" >"$OUT/$name.status"
    echo "   -> $name: $(cat "$OUT/$name.status")"
}

step env 60 bash -c "date -u; nvidia-smi || true; $PY -c 'import sys, torch, triton; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"NO CUDA DEVICE\")'"

if $PY -c "import pytest" 2>/dev/null; then
    # three shards in parallel: kernel compilation (CPU-bound) dominates the test time
    PYTEST=($PY -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels --continue-on-collection-errors -rfEs -o addopts="")
    step tests_attention 240 "${PYTEST[@]}" tests/kernels/test_kernels_paged_attention.py --junitxml="$OUT/tests_attention.xml" &
    step tests_cuda 240 "${PYTEST[@]}" tests/kernels/test_kernels_cuda.py --junitxml="$OUT/tests_cuda.xml" &
    step tests_other 240 "${PYTEST[@]}" tests/kernels -k "not sm90" --ignore=tests/kernels/test_kernels_paged_attention.py \
        --ignore=tests/kernels/test_kernels_cuda.py --junitxml="$OUT/tests_other.xml" &
    wait
else
    step tests_standalone 300 $PY tests/kernels/standalone_check.py --device cuda --json "$OUT/tests_standalone.json"
fi

ELAPSED=$(( $(date +%s) - START ))
BUDGET=$(( 400 - ELAPSED ))            # keep the whole run under ~8 minutes
if [ "$BUDGET" -lt 90 ]; then BUDGET=90; fi
BENCH_ARGS=(--out "$OUT/bench" --budget "$BUDGET")
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then BENCH_ARGS+=(--dry-run); fi   # CPU smoke test of this script
step bench $(( BUDGET + 60 )) $PY bench/kernels.py "${BENCH_ARGS[@]}"

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
