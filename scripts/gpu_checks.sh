#!/usr/bin/env bash
# The checks that need a GPU, in one go (CI has none): the CUDA tests, the actor's MFU on one GPU's share
# of the 8B graph, and the weight sync's time per GB. Each writes its output into OUT_DIR, the most
# telling first, so that a run cut short still brings back what it finished.
#
#   scripts/gpu_checks.sh OUT_DIR
set -u
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
py=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: its output in OUT_DIR/NAME.log, its status and time on stdout
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
  $py -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "no vllm"
  $py -c "import ray; print('ray', ray.__version__)" 2>/dev/null || echo "no ray"; } >"$out/machine.log" 2>&1
cat "$out/machine.log"
step mfu 240 $py scripts/bench_megatron.py --preset qwen3_8b_stage --device cuda --no-bare --json
step sync 150 $py scripts/bench_weight_sync_cuda.py --bf16 --hidden 4096 --layers 16 --layouts colocated --json
step test_cuda 300 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
tail -n 3 "$out"/*.log
