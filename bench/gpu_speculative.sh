#!/usr/bin/env bash
# Speculative decoding at batch 1 on one GPU: `bench latency` on Llama-3-8B (dummy weights, bf16, TP=1, CUDA graphs
# on) without speculation and with n-gram proposals at k = 2, 4, 8 on the input-grounded workload (the prompt holds
# the passage the output copies, so proposals come from the prompt), then k = 4 on random prompts, and the batch
# sizes around where speculation switches itself off; optionally the GPU test suite first (TESTS=1).
#
#   bash bench/gpu_speculative.sh          # on the GPU host, from the project root; records in $OUT
# Wheels the host lacks go in .whl/ (see docs/performance.md: reproducing the GPU figures).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
PY=${PY:-python3}
STEPS=${STEPS:-"plain k2 k4 k8 random4"}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.txt" 2>&1 || cat "$OUT/install.txt"
{ nvidia-smi -L; $PY -c "import torch, triton; print(torch.__version__, triton.__version__)"; git log -1 --format=%H 2>/dev/null; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "${TESTS:-0}" = 1 ]; then
  timeout "${TESTS_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
fi
LAT="--model llama-3-8b --load-format dummy --device cuda --batch-size 1 --input-len 128 --output-len 256 --max-model-len 1024"
ngram() { echo "{\"method\": \"ngram\", \"num_speculative_tokens\": $1, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}"; }
for step in $STEPS; do
  case $step in
    plain) args=(--workload grounded);;
    k2|k4|k8) args=(--workload grounded --speculative-config "$(ngram "${step#k}")");;
    random0) args=(--workload random);;
    random4) args=(--workload random --speculative-config "$(ngram 4)");;
    bs*) n=${step#bs}; n=${n%%k*}; args=(--workload grounded --batch-size "$n" --speculative-config "$(ngram 4)");;
    *) echo "unknown step $step"; continue;;
  esac
  echo "== $step"
  timeout "${STEP_TIMEOUT:-200}" $PY -m shardserve.cli.main bench latency $LAT "${args[@]}" --json-out "$OUT/latency-$step.json" \
    2>&1 | grep -v "^\s*$" | tail -6
done
