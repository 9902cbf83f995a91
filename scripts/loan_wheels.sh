#!/usr/bin/env bash
# Fetch (here, with network) the wheels that `bench/gpu_check.py --loan` needs on a GPU machine without network whose
# Python 3.12 already has torch, transformers, peft, accelerate, pyarrow, pandas, safetensors, tqdm, pyyaml, xxhash,
# fsspec and huggingface-hub: tyro and datasets, and their dependencies that such an image lacks. ~1.2 MB into .whl/.
#   bash scripts/loan_wheels.sh            # then carry .whl/ and run: bash scripts/gpu_loan.sh (docs/gpu.md)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls .whl
