#!/usr/bin/env bash
# bs=1 latency with and without the Triton GEMV (SHARDSERVE_GEMV=1 / 0), paired, on one GPU: Llama-3-8B and
# Qwen3-0.6B (dummy weights), after the GPU engine tests and the GEMV's compiled tests.
#
#   OUT=DIR SHARDSERVE_COMMIT=<hash> bash bench/gemv_ab.sh     # on the GPU host, from the project root
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
ONLY=none BUDGET_S=60 OUT=/tmp/gemv-ab-setup bash bench/gpu_run.sh > /dev/null 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/gpu/test_engine_gpu.py > "$OUT/gpu_tests.txt" 2>&1
echo "engine GPU tests: exit $? ($(tail -1 "$OUT/gpu_tests.txt"))"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py > "$OUT/gemv_tests.txt" 2>&1
echo "GEMV tests (compiled): exit $? ($(tail -1 "$OUT/gemv_tests.txt"))"
for model in llama-3-8b qwen3-0.6b; do
  for run in a b; do
    for v in 1 0; do
      name=latency_${model}_gemv${v}_$run
      SHARDSERVE_GEMV=$v timeout 80 python3 -m shardserve.cli bench latency --model $model --device cuda \
        --load-format dummy --tp 1 --input-len 128 --output-len 256 --max-model-len 1024 \
        --json-out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
      echo "$name: exit $? $(grep -h 'ms/token\|ms per token' "$OUT/$name.txt" | tail -1)"
    done
  done
done
