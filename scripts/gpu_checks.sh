#!/usr/bin/env bash
# The checks that need a GPU, in one go (CI has none), the most telling first, so that a run cut short
# still brings back what it finished:
#   1. graphs/gpu1_grpo.yaml end to end: vLLM on CUDA colocated with the Megatron trainer (sleep and
#      wake), the CUDA weight sync after every update; its history, `plan`'s memory figure against the
#      device's memory in use (nvidia-smi, sampled every 0.5 s), vLLM's log-probs against Megatron's
#   2. vLLM's generation throughput at Qwen3-8B's shape (dummy weights): the strategy vs LLM.generate
#   3. the weight sync into a real vLLM engine (ms per GB), beside the trainer's handoff alone
#   4. tests/test_cuda.py, its vLLM tests first; 5. the actor's MFU on one GPU's share of the 8B graph
#   6. the agent endpoint's overhead with the engine's compute on the device, its agents in the processes
#      of agent_processes: auto (4 on a GPU) and in one (data/agent carried: make agents)
# OUT_DIR gets summary.txt (a line per step and the figures) and logs.tgz (every step's output),
# both rewritten after each step: the device tool brings back few files.
# With GPU_PARTS (scripts/gpu_wheels.sh), the PARTS parts there are unpacked into /tmp/site first.
#
#   [GPU_PARTS=DIR PARTS=N] [GEN_TOKENS=512] [ONLY="gpu1 sync ..."] scripts/gpu_checks.sh OUT_DIR
set -u
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
py=${PYTHON:-python3}
logs=$(mktemp -d)
summary="$out/summary.txt"
: >"$summary"

note() { echo "$*" | tee -a "$summary"; }

if [ -n "${GPU_PARTS:-}" ] && [ ! -d /tmp/site/vllm ]; then
    have=$(ls "$GPU_PARTS"/part-* | wc -l)
    [ "$have" = "${PARTS:-$have}" ] || { note "only $have of $PARTS parts in $GPU_PARTS"; exit 1; }
    start=$SECONDS
    mkdir -p /tmp/site
    cat "$GPU_PARTS"/part-* | $py -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 22)" \
        | tar -x -C /tmp/site || { note "unpacking failed"; exit 1; }
    note "unpacked $have parts in $((SECONDS - start)) s"
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# FlashInfer is left behind (scripts/gpu_wheels.txt); vLLM's sampler would import it unless told
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}

nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 >"$logs/gpu_memory.csv" 2>/dev/null &
sampler=$!
trap 'kill $sampler 2>/dev/null; tar -czf "$out/logs.tgz" -C "$logs" .' EXIT

step() {  # step NAME SECONDS COMMAND...: stdout in NAME.out, stderr in NAME.log; status, time, peak memory
    local name=$1 limit=$2 start=$SECONDS from
    shift 2
    [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]] || return 0
    from=$(wc -l <"$logs/gpu_memory.csv")
    timeout "$limit" "$@" >"$logs/$name.out" 2>"$logs/$name.log"
    local rc=$?
    local peak
    peak=$(tail -n +"$((from + 1))" "$logs/gpu_memory.csv" | cut -d, -f2 | sort -n | tail -1)
    note "$name: exit $rc in $((SECONDS - start)) s, device memory used at most ${peak:-?} MiB"
    tar -czf "$out/logs.tgz" -C "$logs" .
    return $rc
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
  $py -c "import vllm, ray, megatron.core as m; print('vllm', vllm.__version__, 'ray', ray.__version__, 'megatron-core', m.__version__)"
} 2>&1 | grep -v Warning | tee -a "$summary"
mem_gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{printf "%d", $1 / 1024}')

# 1. the one-GPU pipeline
[ -f data/gpu1/model/model.safetensors ] || $py scripts/make_tiny_model.py data/gpu1/model --arch qwen3 --hidden-size 1024 \
    --num-layers 28 --num-heads 8 --num-kv-heads 4 --intermediate-size 3072 --untied >/dev/null 2>&1
[ -f data/gpu1/train.parquet ] || $py scripts/make_demo_task.py data/gpu1 --data-only >/dev/null 2>&1
step gpu1_plan 60 $py -m siirl_dag.main plan graphs/gpu1_grpo.yaml cluster.device_memory_gb="$mem_gb"
grep -E 'at its peak|fullest' "$logs/gpu1_plan.out" | sort -u | tee -a "$summary"
step gpu1 240 $py -m siirl_dag.main graphs/gpu1_grpo.yaml --json cluster.device_memory_gb="$mem_gb" \
    trainer.log_dir="$logs/gpu1_libraries" trainer.tensorboard_dir="$logs/gpu1_tb"
# from the run's events, so a run cut short still reports its steps
$py scripts/gpu_run_summary.py "$logs/gpu1_tb" --memory-csv "$logs/gpu_memory.csv" --plan "$logs/gpu1_plan.out" \
    2>&1 | tee -a "$summary"

# 2. generation throughput at the 8B graph's per-engine batch (32 prompts x 8), eager
step vllm_8b 180 $py scripts/bench_vllm.py --shape qwen3_8b --prompts 32 --n 8 --prompt-tokens 1024 \
    --new-tokens "${GEN_TOKENS:-512}" --repeats 1 --enforce-eager --json
tail -n 20 "$logs/vllm_8b.out" | tee -a "$summary"

# 3. the sync into vLLM, per GB
step sync 150 $py scripts/bench_weight_sync_cuda.py --bf16 --hidden 2048 --layers 16 --layouts colocated,vllm --repeats 5 --json
grep -E '"layout"|sync_ms_per_GB|ratio_to_device|"bytes"|"mean"|"max"' "$logs/sync.out" | tee -a "$summary"
# vLLM's loader has a fixed cost per tensor (17.5x a device copy at hidden 2048): how it weighs at a larger model
step sync_4096 150 $py scripts/bench_weight_sync_cuda.py --bf16 --hidden 4096 --layers 16 --layouts vllm --repeats 5 --json
grep -E '"layout"|sync_ms_per_GB|ratio_to_device|"bytes"' "$logs/sync_4096.out" | tee -a "$summary"

# 4. the CUDA tests, vLLM's first
step test_cuda_vllm 200 $py -m pytest -q -p no:cacheprovider -rfE tests/test_cuda.py -k vllm
tail -n 5 "$logs/test_cuda_vllm.out" | tee -a "$summary"
step test_cuda 200 $py -m pytest -q -p no:cacheprovider -rfE tests/test_cuda.py -k "not vllm"
tail -n 5 "$logs/test_cuda.out" | tee -a "$summary"

# 5. the actor's MFU
step mfu 150 $py scripts/bench_megatron.py --preset qwen3_8b_stage --device cuda --no-bare --json
tail -n 12 "$logs/mfu.out" | tee -a "$summary"

# 6. the agent endpoint's overhead where the engine's compute is on the device, not beside the agents
if [ -f data/agent/model/config.json ]; then
    step agents 200 $py scripts/bench_agent.py --overhead --rounds 9 --json
    tail -n 1 "$logs/agents.out" | tee -a "$summary"
    # the first calls of 128 episodes leave one process one after another: in four, the ramp is a quarter
    step agents1 200 $py scripts/bench_agent.py --overhead --rounds 9 --agent-processes 1 --json
    tail -n 1 "$logs/agents1.out" | tee -a "$summary"
elif [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" agents "* ]]; then
    note "agents: skipped (no data/agent: make agents here, and carry it)"
fi
