#!/usr/bin/env bash
# The CUDA paths on one GPU, in under 10 minutes (issue 54): eager and compiled runtimes (peaks by
# torch.cuda.max_memory_allocated against prediction, gradients), offload, analytical vs measured
# costs. Exits non-zero where torch.cuda.is_available() is false, or when a check fails.
#     scripts/cuda_check.sh            # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec timeout 570 "$PY" scripts/cuda_check.py
