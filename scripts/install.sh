#!/usr/bin/env bash
# Install rlkit into ./.venv (created if missing) with the test tools.
#   bash scripts/install.sh            # then: .venv/bin/python recipes/grpo.py
# torch: an already-installed torch is kept. Otherwise a machine with an NVIDIA GPU gets the
# default (CUDA) build; a CPU-only machine gets the CPU build -- from a local wheel when pip's
# find-links offer one, else from PyTorch's CPU index -- so no multi-GB CUDA download happens.
# Everything else is installed with torch pinned to the version now present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${RLKIT_TORCH_VERSION:-2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

if ! .venv/bin/python -c "import importlib.metadata as m; m.version(\"torch\")" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[rlkit] GPU found: installing torch (CUDA build)"
    "${PIP[@]}" install torch
  elif "${PIP[@]}" install --no-index --no-deps "torch==$TORCH_VERSION" 2>/dev/null; then
    echo "[rlkit] installed torch $TORCH_VERSION (CPU) from a local wheel"
  else
    echo "[rlkit] no GPU: installing torch (CPU build) from PyTorch's CPU index"
    "${PIP[@]}" install torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
.venv/bin/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > .venv/torch-constraint.txt
"${PIP[@]}" install -c .venv/torch-constraint.txt -e ".[dev]"
echo "[rlkit] installed: $(.venv/bin/python -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
