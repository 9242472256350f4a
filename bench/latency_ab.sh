#!/usr/bin/env bash
# bs=1 latency with an engine setting at each of its values (FLAG=--setting, VALUES="v1 v2"), paired runs on one
# GPU:
# MODELS (default Llama-3-8B, then Qwen3-0.6B; dummy weights), RUNS pairs each (default "a b"), after the GPU tests
# (GPU_TESTS: `-m gpu` tests, default the GPU suite; KERNEL_TESTS: kernel tests run compiled, default the one-row
# layer's and the GEMV's).
#
#   OUT=DIR SHARDSERVE_COMMIT=<hash> FLAG=--split-mixed-decodes VALUES="0 1" bash bench/latency_ab.sh   # on the GPU host
# Outputs: log.txt and results.tgz (test logs, each run's output and JSON record).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
: "${FLAG:?FLAG=--setting names the engine flag}"; : "${VALUES:?VALUES names its values}"; MODELS=${MODELS:-"llama-3-8b qwen3-0.6b"}; RUNS=${RUNS:-"a b"}
GPU_TESTS=${GPU_TESTS-tests/gpu}; KERNEL_TESTS=${KERNEL_TESTS-"tests/kernels/test_one_row_layer.py tests/kernels/test_gemv.py"}
WORK=$(mktemp -d)
say() { echo "[latency_ab $SECONDS s] $*" | tee -a "$OUT/log.txt"; }
ONLY=none BUDGET_S=60 OUT=$WORK/setup bash bench/gpu_run.sh > /dev/null 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
say "setup done: $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' 2>&1)"
run_tests() {  # run_tests NAME PYTEST_ARGS...
  local name=$1; shift
  timeout -k 5 ${TEST_LIMIT_S:-240} python3 -m pytest -q -p no:cacheprovider -rfEs "$@" > "$WORK/$name.txt" 2>&1
  say "$name: exit $? ($(tail -1 "$WORK/$name.txt"))"; grep -E "^(FAILED|ERROR)" "$WORK/$name.txt" | head -20 | tee -a "$OUT/log.txt"
}
[ -n "$KERNEL_TESTS" ] && run_tests kernel_tests $KERNEL_TESTS
[ -n "$GPU_TESTS" ] && run_tests gpu_tests -m gpu $GPU_TESTS
for model in $MODELS; do
  for run in $RUNS; do
    for v in $VALUES; do
      name=latency_${model}_${FLAG#--}${v}_$run
      timeout 90 python3 -m shardserve.cli.main bench latency --model $model --device cuda \
        --load-format dummy --tp 1 --input-len 128 --output-len 256 --max-model-len 1024 $FLAG $v \
        --json-out "$WORK/$name.json" > "$WORK/$name.txt" 2>&1
      say "$name: exit $? $(grep -h 'ms/token\|ms per token' "$WORK/$name.txt" | tail -1)"
    done
  done
done
tar -C "$WORK" -czf "$OUT/results.tgz" --exclude setup . && say "results.tgz written"
