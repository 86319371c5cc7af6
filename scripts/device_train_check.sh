#!/usr/bin/env bash
# Device check of the LM drafters on one GPU (<= 10 minutes on an H200): decode latency per
# token step for each backend path (HF eager generate, dynamic loop, static cache, CUDA
# graph, torch.compile) on a Qwen3-0.6B-shaped model; a small Qwen3 model trained on the
# traces with top-1/top-5 exact match on held-out tasks. Prints a JSON summary and writes
# $OUT/device_check.json when $OUT is set. Runs from the repository root without an install.
#   scripts/device_train_check.sh [--traces DIR] [--budget-s 540] [--smoke]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && ! "$PY" -c "import torch" 2>/dev/null; then PY=.venv/bin/python; fi
exec timeout --signal=INT --kill-after=20 590 "$PY" scripts/device_train_check.py "$@"
