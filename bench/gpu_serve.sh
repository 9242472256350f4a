#!/usr/bin/env bash
# The GPU serving benchmark: `shardserve serve` (dummy weights, CUDA, TP=1) and in front of it the HTTP gateway
# (`shardserve gateway --workers GATEWAY_WORKERS`, default 4 processes; 0: the gateway on a thread of the serve
# process), a request-rate sweep up to saturation through gRPC and through the gateway (`shardserve bench serve --api
# both`), for Qwen3-0.6B and Llama-3-8B, within one time budget.
#
#   bash bench/gpu_serve.sh               # on the GPU host, from the project root; writes to $OUT (default ./gpu-serve-out)
#   SMOKE=1 bash bench/gpu_serve.sh       # on a CPU machine: the same commands on a tiny model (checks the plumbing)
#
# Wheels (the host has no package index): what bench/gpu_run.sh brings (ray & co., grpcio-health-checking,
# grpcio-reflection: bash ../shared/tools/gpu-wheels.sh .whl) plus the gateway's: bash bench/gateway_wheels.sh .whl
# (fastapi, starlette, pydantic, pydantic-core, uvicorn, httptools, uvloop, ... as cp312 wheels, ~8 MiB). Without them the HTTP side
# is skipped and gRPC alone is measured.
# Output ($OUT): serve_<model>.json (one BenchRecord per rate and API, a JSON list), serve_<model>.png (latency
# against throughput), serve_<model>.txt (the benchmark's output), log.txt, env.txt, summary.txt.
# Models run one per GPU side by side when there are two GPUs, else one after the other. BUDGET_S (default 300)
# bounds the whole run: a model starts only with time left for it, and each has its own timeout.
# Knobs: MODELS, GATEWAY_WORKERS, RATES_<model> (e.g. RATES_qwen3=16,32,64,128,inf), NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN,
# SHARDSERVE_COMMIT=<hash> (names the tree in the records; the host's .git may be stale).
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-serve-out}
PY=${PY:-python3}
SMOKE=${SMOKE:-0}
GATEWAY_WORKERS=${GATEWAY_WORKERS:-4}
BUDGET_S=${BUDGET_S:-300}
START=$(date +%s)
WORK=$(mktemp -d /tmp/shardserve-gpu-serve.XXXXXX)
mkdir -p "$OUT"
LOG=$OUT/log.txt
: > "$LOG"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off everywhere
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # Ray and every server on loopback only
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/shardserve-triton-cache}
[ "$SMOKE" = 1 ] && export TRITON_INTERPRET=1

say() { echo "[gpu_serve $(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
elapsed() { echo $(( $(date +%s) - START )); }

# ---- setup: bench/gpu_run.sh's own (wheels from .whl/ into /tmp/site, the project editable, else a path shim), ----
# taken from that file so that the two scripts install the same way. It uses ROOT, OUT, PY, SMOKE, WORK, LOG, say.
eval "$(sed -n '/^setup() {$/,/^}$/p' bench/gpu_run.sh)"
declare -f setup > /dev/null || { echo "bench/gpu_run.sh has no setup() any more" >&2; exit 1; }
setup
{
  echo "date: $(date -u +%FT%TZ)  commit: ${SHARDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}  smoke: $SMOKE"
  $PY -c "
import importlib
for name in ('torch', 'grpc', 'ray', 'fastapi', 'starlette', 'pydantic', 'uvicorn', 'matplotlib'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', '?'))
    except Exception as exc:
        print(name, 'NOT IMPORTABLE:', exc)"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >> "$LOG"

API=both
if ! (cd /tmp && $PY -c "import fastapi, uvicorn") > /dev/null 2>&1; then
  API=grpc; say "WARNING: fastapi/uvicorn not importable (bash bench/gateway_wheels.sh .whl): gRPC only"
fi
PLOT=1
(cd /tmp && $PY -c "import matplotlib") > /dev/null 2>&1 || { PLOT=0; say "matplotlib not importable: no plots"; }

if [ "$SMOKE" = 1 ]; then
  $PY -c "from tests.hf_reference import make_tiny_model; make_tiny_model('$WORK/tiny', 'llama', num_heads=4, num_kv_heads=2)" >> "$LOG" 2>&1
  MODELS=${MODELS:-tiny}; DEV="--device cpu --num-kv-blocks 128 --max-model-len 256"
  NUM_PROMPTS=${NUM_PROMPTS:-8}; INPUT_LEN=${INPUT_LEN:-16-32}; OUTPUT_LEN=${OUTPUT_LEN:-4-8}
  RATES_tiny=${RATES_tiny:-8,inf}; LIMIT_tiny=240; MIN_tiny=60
else
  MODELS=${MODELS:-"qwen3 llama8b"}; DEV="--device cuda --max-model-len 2048"
  NUM_PROMPTS=${NUM_PROMPTS:-200}; INPUT_LEN=${INPUT_LEN:-256}; OUTPUT_LEN=${OUTPUT_LEN:-128}
  # Saturation is about offline tok/s / OUTPUT_LEN: ~24k/128 = 190 req/s (Qwen3-0.6B), ~10k/128 = 80 (Llama-3-8B).
  RATES_qwen3=${RATES_qwen3:-16,32,64,128,inf}; LIMIT_qwen3=200; MIN_qwen3=90
  RATES_llama8b=${RATES_llama8b:-8,16,32,64,inf}; LIMIT_llama8b=260; MIN_llama8b=120
fi
declare -A NAME=([qwen3]=qwen3-0.6b [llama8b]=llama-3-8b [tiny]=$WORK/tiny)
NGPU=$(command -v nvidia-smi > /dev/null && nvidia-smi -L 2>/dev/null | wc -l || echo 0)

declare -A PIDS RC
run_model() {  # run_model KEY GPU: one sweep in the background
  local key=$1 gpu=$2 limit_var=LIMIT_$1 min_var=MIN_$1 rates_var=RATES_$1
  local limit=${!limit_var} left=$(( BUDGET_S - $(elapsed) ))
  if (( left < ${!min_var} )); then RC[$key]=skipped; say "$key: skipped (${left}s of the budget left)"; return; fi
  (( limit > left )) && limit=$left
  local plot=; [ "$PLOT" = 1 ] && plot="--plot $OUT/serve_$key.png"
  local cmd="$PY -m shardserve.cli.main bench serve --model ${NAME[$key]} --load-format dummy $DEV --api $API
    --gateway-workers $GATEWAY_WORKERS
    --request-rates ${!rates_var} --num-prompts $NUM_PROMPTS --input-len $INPUT_LEN --output-len $OUTPUT_LEN
    --json-out $OUT/serve_$key.json $plot"
  say "$key: start (limit ${limit}s, GPU $gpu): $(echo $cmd)"
  (
    [ "$SMOKE" != 1 ] && export CUDA_VISIBLE_DEVICES=$gpu
    exec timeout -k 20 "$limit" $cmd
  ) > "$OUT/serve_$key.txt" 2>&1 &
  PIDS[$key]=$!
}
finish_model() {
  local key=$1
  [ -z "${PIDS[$key]:-}" ] && return
  wait "${PIDS[$key]}"; RC[$key]=$?
  say "$key: exit ${RC[$key]}"
  { echo "===== $key"; grep -v "req/s\]" "$OUT/serve_$key.txt" | tail -60; } >> "$LOG"
}

set -- $MODELS
if (( NGPU >= 2 )) && (( $# >= 2 )); then
  run_model "$1" 0; run_model "$2" 1; finish_model "$1"; finish_model "$2"; shift 2
fi
for key in "$@"; do run_model "$key" 0; finish_model "$key"; done

# ---- summary ----------------------------------------------------------------------------------------------------
{
  for key in $MODELS; do echo "$key: exit ${RC[$key]:-?}"; done
  for f in "$OUT"/serve_*.json; do
    [ -f "$f" ] || continue
    $PY - "$f" <<'EOF'
import json, sys
records = json.load(open(sys.argv[1]))
records = records if isinstance(records, list) else [records]
print(f"{records[0]['model']} (tp={records[0]['tp']}), {records[0]['workload']['num_prompts']} requests, "
      f"in {records[0]['workload']['input_len']} out {records[0]['workload']['output_len']}")
print(f"{'api':<5} {'rate':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
      f"{'ITL p50':>8} {'E2E p50':>9} {'failed':>6}")
for r in records:
    n = r["notes"]
    if not n["completed"]:
        print(f"{n['api']:<5} {str(r['workload']['request_rate']):>6} all {n['failed']} failed: {n['errors']}")
        continue
    print(f"{n['api']:<5} {str(r['workload']['request_rate']):>6} {n['request_throughput']:7.2f} "
          f"{r['output_tokens_per_s']:10.0f} {r['ttft_ms']['p50']:9.1f} {r['ttft_ms']['p99']:8.1f} "
          f"{(r['tpot_ms'] or {}).get('p50', 0):9.2f} {(r['tpot_ms'] or {}).get('p99', 0):7.2f} "
          f"{(r['itl_ms'] or {}).get('p50', 0):8.2f} "
          f"{r['e2e_ms']['p50']:9.0f} {n['failed']:6d}")
EOF
  done
  echo "total: $(elapsed)s of a ${BUDGET_S}s budget; outputs in $OUT"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt" | tee -a "$LOG"
rm -rf "$WORK"
