#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
#   scripts/setup.sh          core simulator only (simpy, numpy, pandas, pyarrow, click, rich, pyyaml)
#   scripts/setup.sh full     + the GPU side (torch CPU build, triton, transformers), the test tools and ray
# torch is installed FIRST and pinned to the CPU build lying on this disk; a looser requirement
# would make pip fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SIMKV_VENV:-.venv}"
MODE="${1:-core}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
STAMP="$VENV/.simkv-$MODE-$(cat pyproject.toml requirements/constraints.txt | sha1sum | cut -c1-12)"
if [ -e "$STAMP" ]; then
    exit 0
fi
if [ "$MODE" = "full" ]; then
    "${PIP[@]}" -c requirements/constraints.txt "torch==2.13.0"
    "${PIP[@]}" -c requirements/constraints.txt -e ".[gpu,test,ray]"
else
    "${PIP[@]}" -c requirements/constraints.txt -e .
fi
touch "$STAMP"
