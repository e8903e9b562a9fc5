#!/usr/bin/env bash
# Every GPU-only check of tandem in one prepared run of at most 8 minutes: the environment
# (`uv sync`: CUDA torch from the package index, cupy), the `gpu`-marked tests of each
# package, then the GPU sections of the benchmarks, each step under its own time limit.
# Writes one summary file into $OUT (default runs/gpu_check/) and prints it.
#   scripts/gpu_check.sh             on a CUDA machine
#   scripts/gpu_check.sh --dry-run   the same plan rehearsed on a CPU, no device call
#   PYTHON=/env/bin/python scripts/gpu_check.sh   use an environment made beforehand
# The plan, its limits and the summary format are in scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/gpu_check.py "$@"
