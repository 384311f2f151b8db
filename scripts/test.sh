#!/usr/bin/env bash
# The project's test command (README.md and .ci/run call exactly this).
# Installs everything the tests need into .venv (torch CPU build first), then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh full
exec .venv/bin/python -m pytest -q "$@"
