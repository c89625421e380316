#!/usr/bin/env bash
# Packs vLLM for CUDA, Ray and megatron-core for the lent GPU machine, which has torch 2.11 (CUDA 13)
# but none of these, reaches no registry, and takes at most 64 MiB per command (../.library/device).
# Runs here: downloads the wheels of scripts/gpu_wheels.txt for CPython 3.12 on x86-64, installs them
# into one folder (pip --target, for that platform), drops what a one-GPU bf16 run on a Hopper chip
# never loads, compresses it (xz) and cuts it into parts of PART_MB (default 60) MiB, each in its own
# folder OUT/pN, to be carried one per command. Then prints the commands, for the device tool's `run`:
# each but the last copies its part out of the working tree into /tmp/gpu_parts (files outside the tree
# stay on a warm machine between commands); the last brings the final part and runs
# scripts/gpu_checks.sh, which joins the parts and unpacks them into /tmp/site first.
#
#   scripts/gpu_wheels.sh [OUT=.whl]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
part_mb=${PART_MB:-60}
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

platform=(--only-binary=:all: --python-version 3.12 --implementation cp)
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 linux; do
    platform+=(--platform "${tag}_x86_64")
done
echo "downloading $(grep -c '==' scripts/gpu_wheels.txt) wheels" >&2
$py -m pip download -q --no-deps "${platform[@]}" -d "$work/wheels" -r scripts/gpu_wheels.txt
$py -m pip install -q --no-index --no-deps --no-compile "${platform[@]}" --target "$work/site" "$work"/wheels/*.whl
# Never loaded by a one-GPU bf16 run on an H100/H200: FlashAttention 2's kernels (Hopper runs FA3),
# vLLM's Rust front end and the sources of kernels for other chips, xgrammar's static library,
# Ray's Java jars, Mistral's tokenizer tables, console scripts.
cd "$work/site"
rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 \
       xgrammar/lib/libxgrammar.a ray/jars mistral_common/data/tekken_*.json bin
echo "unpacked: $(du -sm . | cut -f1) MiB; compressing (a few minutes)" >&2
tar -cf - . | xz -T0 -6 >"$work/site.tar.xz"
cd - >/dev/null
rm -rf "$out"
mkdir -p "$out"
split -b "${part_mb}M" -d -a 2 "$work/site.tar.xz" "$work/part-"
n=0
for f in "$work"/part-*; do
    n=$((n + 1))
    mkdir "$out/p$n"
    mv "$f" "$out/p$n/"
done
echo "$(du -sm "$out" | cut -f1) MiB in $n parts under $out" >&2

echo "# device tool, one command per part, each within ~30 s of the last (a warm machine keeps /tmp):"
for i in $(seq 1 $((n - 1))); do
    echo "run carry=[\"$out/p$i\"]: mkdir -p /tmp/gpu_parts && cp $out/p$i/* /tmp/gpu_parts/ && ls /tmp/gpu_parts | wc -l"
done
# the agent demo's task (make agents, 4 MiB) rides with the last part, for the agents check
agent=$([ -f data/agent/model/config.json ] && echo ", \"data/agent\"" || true)
echo "run carry=[\"$out/p$n\"$agent]: mkdir -p /tmp/gpu_parts && cp $out/p$n/* /tmp/gpu_parts/ && GPU_PARTS=/tmp/gpu_parts PARTS=$n scripts/gpu_checks.sh \$OUT"
