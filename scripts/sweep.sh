#!/usr/bin/env bash
# The main job on a fresh machine: create ./.venv, install aospec (core, no extras), and replay
# the agent traces bundled with aospec across model speeds (aospec sweep --bundled).
# Usage: scripts/sweep.sh [aospec sweep options...]   e.g. --tpot-ms 10,1 --out my-results
# An existing .venv with aospec installed is used as it is (nothing is installed then).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/aospec ]; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
exec .venv/bin/aospec sweep --bundled "$@"
