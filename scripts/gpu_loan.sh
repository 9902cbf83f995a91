#!/usr/bin/env bash
# On a GPU machine with no network (Python 3.12, torch with CUDA, transformers, peft, pyarrow, pandas, safetensors
# preinstalled): install the wheels scripts/loan_wheels.sh put in .whl/ into a temporary folder (nothing else is
# touched), print the machine and the versions, then run the loan profile of the GPU check (<= 8 min on one GPU).
#   bash scripts/gpu_loan.sh [--out DIR] [--rows a,b]     # arguments go to bench/gpu_check.py --loan
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${RLKIT_LOAN_SITE:-/tmp/rlkit-loan-site}
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || {
  echo "[gpu_loan] could not install .whl/*.whl: run scripts/loan_wheels.sh on a machine with network first" >&2
  exit 2
}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "[gpu_loan] no nvidia-smi"
"$PY" -c "import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'peft', 'pyarrow', 'datasets', 'tyro')))"
exec "$PY" bench/gpu_check.py --loan "$@"
