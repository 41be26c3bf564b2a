#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): run it first on a machine with a GPU, from anywhere.
#   benchmarks/gpu_check.sh [--out gpu_check.json] [--budget 470] [--only bench_none,...]
# TORCH_PYTHON=/path/to/python picks the interpreter of the PyTorch baselines (default: this one).
set -euo pipefail
cd "$(dirname "$0")/.."
exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python}" benchmarks/gpu_check.py "$@"
