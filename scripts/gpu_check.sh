#!/usr/bin/env bash
# Every GPU check of tandem-moe-determinism, in one run (a few minutes on one GPU):
#   1. compiled Triton kernels: bitwise batch invariance (fp32, bf16) and time vs cuBLAS/SDPA;
#   2. the `gpu`-marked tests of the package;
#   3. the Triton kernels' interpreter checks (CPU) for comparison.
# Usage: scripts/gpu_check.sh   (PYTHON=/path/to/python to skip `uv run`)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then
  PY=("$PYTHON")
elif [[ -x .venv/bin/python ]]; then
  PY=(.venv/bin/python)
else
  PY=(uv run python)
fi

if ! "${PY[@]}" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device; run this on a GPU machine" >&2
  exit 1
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L || true

status=0
echo "== 1/3 compiled Triton kernels: invariance and overhead vs stock CUDA ops"
timeout 600 "${PY[@]}" benchmarks/determinism.py --gpu || status=1

echo "== 2/3 gpu tests"
timeout 600 "${PY[@]}" -m pytest packages/moe-determinism -m gpu -q -p no:cacheprovider || status=1

echo "== 3/3 Triton interpreter checks (CPU, fp32)"
TRITON_INTERPRET=1 timeout 600 "${PY[@]}" packages/moe-determinism/tests/triton_interpreter_checks.py || status=1

if [[ $status -eq 0 ]]; then echo "gpu_check: all passed"; else echo "gpu_check: FAILED" >&2; fi
exit $status
