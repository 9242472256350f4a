#!/usr/bin/env bash
# The attention and sampling kernels on one GPU, in one call: their GPU tests, each attention kernel's bytes/s, the
# decode kernel's launch-setting sweep and mixed batches as one launch or split (bench/attention_rates.py), top-p
# timing (tests/gpu/sampling_timing.py), then the offline runs of Qwen3-0.6B and Llama-3-8B with the bf16 and the FP8
# cache (bench/gpu_run.sh's steps).
#
#   OUT=DIR BUDGET_S=480 bash bench/gpu_kernels.sh     # on the GPU host, from the project root
#
# STEPS / OFFLINE / SWEEP_ARGS narrow the run. Outputs: log.txt and results.tgz (everything else: few files come back from the device machine).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; BUDGET_S=${BUDGET_S:-480}; PY=${PY:-python3}
STEPS=${STEPS:-"tests rates topp offline"}
START=$(date +%s)
mkdir -p "$OUT"
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
say() { echo "[gpu_kernels $(( $(date +%s) - START ))s] $*" | tee -a "$OUT/log.txt"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_INTERPRET=0
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/shardserve-triton-cache}
# the project's setup (wheels, editable install) through gpu_run.sh with no step
ONLY=none BUDGET_S=60 OUT=$OUT/setup bash bench/gpu_run.sh > /dev/null 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cp "$OUT/setup/env.txt" "$OUT/env.txt" 2> /dev/null
say "setup done"

if want tests; then
  timeout -k 5 $(( $(left) < 150 ? $(left) : 150 )) $PY -m pytest -q -p no:cacheprovider -m gpu -rfEs \
    ${TEST_ARGS:-tests/gpu/test_kernels_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_sampling_gpu.py} \
    > "$OUT/gpu_tests.txt" 2>&1
  say "tests: exit $? ($(tail -1 "$OUT/gpu_tests.txt"))"
fi
if want rates && (( $(left) > 60 )); then
  timeout -k 5 $(( $(left) < 240 ? $(left) : 240 )) $PY -m shardserve.bench.attention_rates --model qwen3-0.6b \
    ${SWEEP_ARGS:---sweep --mixed 64x1024,256x800} --json-out "$OUT/attention_qwen3.json" > "$OUT/attention_qwen3.txt" 2>&1
  say "attention rates + sweep: exit $?"; grep -E "^(attention decode|sweep|mixed)" "$OUT/attention_qwen3.txt" | tee -a "$OUT/log.txt"
fi
if want topp && (( $(left) > 40 )); then
  timeout -k 5 90 $PY tests/gpu/sampling_timing.py "$OUT/topp_timing.json" > "$OUT/topp_timing.txt" 2>&1
  say "top-p timing: exit $?"; cat "$OUT/topp_timing.txt" | tee -a "$OUT/log.txt"
fi
if want offline && (( $(left) > 60 )); then
  ONLY=${OFFLINE:-"offline_qwen3 offline_qwen3_fp8 offline_llama8b_fp8 offline_llama8b"} BUDGET_S=$(left) OUT=$OUT/offline \
    bash bench/gpu_run.sh > /dev/null 2>&1
  say "offline runs: exit $?"; tail -8 "$OUT/offline/summary.txt" | tee -a "$OUT/log.txt"
fi
# few files come back from the device machine: everything in one archive (log.txt then holds the last line only)
(cd "$OUT" && tar czf /tmp/gpu_kernels.tgz . && rm -rf ./* && mv /tmp/gpu_kernels.tgz results.tgz)
echo "[gpu_kernels $(( $(date +%s) - START ))s] done" >> "$OUT/log.txt"
