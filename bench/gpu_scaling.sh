#!/usr/bin/env bash
# The GPU scaling run: `shardserve bench scaling` on the two-GPU host as two Ray nodes (a head raylet on GPU 0 and a
# worker raylet on GPU 1, each --num-gpus 1, so that placement crosses a node boundary), 1x1, 2x1 and 1x2 for
# Qwen3-0.6B and Llama-3-8B (dummy weights), cache-aware against round-robin routing on the shared-prefix workload
# at 2x1 with each replica's KV cache capped below the prefixes' working set; first, the load generator alone
# against the fake upstream (how many tokens/s its processes can read). All in one call, within one time budget.
#
#   bash bench/gpu_scaling.sh             # on the GPU host, from the project root; writes to $OUT (default ./gpu-scaling-out)
#   SMOKE=1 bash bench/gpu_scaling.sh     # on a CPU machine: tiny models, Ray started by the benchmark (loopback,
#                                         # one node: no `ray start`, which needs a multi-node setting here)
#
# Wheels as for bench/gpu_run.sh (ray & co. in .whl/). Output ($OUT): scaling_<model>/ (scaling.csv, .md, .png,
# .json: bench scaling's outputs, written after every configuration), client_check.txt, log.txt, env.txt,
# summary.txt. BUDGET_S (default 370) bounds the whole run; each model has its own timeout. Knobs: MODELS, CONFIGS,
# KV_BLOCKS (the shared-prefix runs' blocks per replica), CLIENT_CHECK=0, CLIENT_PROCS, LIMIT_QWEN3 / LIMIT_LLAMA (each
# model's seconds), EXTRA (more `bench scaling` flags, given last: they win), EXTRA_B (flags of a second pass of
# every model, after the first, into scaling_<model>_b/), SHARDSERVE_COMMIT=<hash> (names the tree).
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-scaling-out}
PY=${PY:-python3}
SMOKE=${SMOKE:-0}
BUDGET_S=${BUDGET_S:-370}
START=$(date +%s)
WORK=$(mktemp -d /tmp/shardserve-gpu-scaling.XXXXXX)
mkdir -p "$OUT"
LOG=$OUT/log.txt
: > "$LOG"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off everywhere
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/shardserve-triton-cache}
# Two raylets need the multi-node setting (the GPU host reaches nothing outside it); every address given is loopback.
# On a CPU machine Ray stays on loopback only, one node.
if [ "$SMOKE" = 1 ]; then export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 TRITON_INTERPRET=1
else export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1; fi

say() { echo "[gpu_scaling $(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
elapsed() { echo $(( $(date +%s) - START )); }

# ---- setup: bench/gpu_run.sh's own (wheels from .whl/ into /tmp/site, the project editable, else a path shim) ----
eval "$(sed -n '/^setup() {$/,/^}$/p' bench/gpu_run.sh)"
declare -f setup > /dev/null || { echo "bench/gpu_run.sh has no setup() any more" >&2; exit 1; }
setup
{
  echo "date: $(date -u +%FT%TZ)  commit: ${SHARDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}  smoke: $SMOKE"
  $PY -c "
import importlib, os
for name in ('torch', 'grpc', 'ray', 'matplotlib', 'tqdm'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', '?'))
    except Exception as exc:
        print(name, 'NOT IMPORTABLE:', exc)
print('cpus', os.cpu_count())"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >> "$LOG"

RAY_CLI='import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; main()'  # `ray`, by this Python
if [ "$SMOKE" = 1 ]; then
  $PY -c "
from tests.hf_reference import make_tiny_model
make_tiny_model('$WORK/qwen3', 'qwen3', num_heads=4, num_kv_heads=2)
make_tiny_model('$WORK/llama8b', 'llama', num_heads=4, num_kv_heads=2)" >> "$LOG" 2>&1
  MODELS=${MODELS:-"qwen3 llama8b"}
  declare -A NAME=([qwen3]=$WORK/qwen3 [llama8b]=$WORK/llama8b) LIMIT=([qwen3]=400 [llama8b]=400)
  RAY_ADDRESS_ARG=local
  DEV="--device cpu --dtype float32 --max-model-len 256 --num-kv-blocks 96"
  LOAD="--num-prompts 4 --input-len 16 --output-len 4 --prefixes 2 --prefix-len 48 --per-prefix 4 --suffix-len 4
        --prefix-output-len 3 --concurrency 2"
  KV_BLOCKS=${KV_BLOCKS:-40}; CHECK="--num-prompts 32 --output-len 16"; CHECK_PROCS=1,2
else
  MODELS=${MODELS:-"qwen3 llama8b"}
  declare -A NAME=([qwen3]=qwen3-0.6b [llama8b]=llama-3-8b) LIMIT=([qwen3]=${LIMIT_QWEN3:-140} [llama8b]=${LIMIT_LLAMA:-400})
  PORT=6391
  # a raylet per GPU: placement crosses a node boundary (the environment notes: seen working on this host)
  env CUDA_VISIBLE_DEVICES=0 $PY -c "$RAY_CLI" start --head --node-ip-address 127.0.0.1 --port $PORT --num-gpus 1 --num-cpus 6 \
    --include-dashboard=false --disable-usage-stats >> "$LOG" 2>&1 && say "head raylet up (GPU 0)"
  env CUDA_VISIBLE_DEVICES=1 $PY -c "$RAY_CLI" start --address 127.0.0.1:$PORT --node-ip-address 127.0.0.1 --num-gpus 1 \
    --num-cpus 6 --disable-usage-stats >> "$LOG" 2>&1 && say "worker raylet up (GPU 1)"
  $PY -c "import ray; ray.init(address='127.0.0.1:$PORT'); print('nodes', [(n['NodeID'][:8], n['Resources'].get('GPU')) for n in ray.nodes() if n['Alive']])" >> "$LOG" 2>&1
  RAY_ADDRESS_ARG=127.0.0.1:$PORT
  # Offline: 256 prompts of 256 tokens, 128 out, at most 128 in a replica's batch (each replica runs full batches at
  # 1x1 and at 2x1 alike). Shared prefix: 16 prefixes of 1,024 tokens x 16 requests (32-token tails, 64 out) at 64
  # in flight; the A/B runs keep KV_BLOCKS blocks of 16 tokens per replica: 896 hold 8 prefixes and the running
  # requests' own blocks (what cache-aware routing sends one replica) but not all 16 (what round-robin sends it).
  DEV="--device cuda --load-format dummy --max-model-len 2048 --max-num-seqs 128"
  LOAD="--num-prompts 256 --input-len 256 --output-len 128 --prefixes 16 --prefix-len 1024 --per-prefix 16
        --suffix-len 32 --prefix-output-len 64 --concurrency 64"
  KV_BLOCKS=${KV_BLOCKS:-896}; CHECK="--num-prompts 256 --output-len 128"; CHECK_PROCS=1,2,4
fi

CONFIGS=${CONFIGS:-1x1,2x1,1x2}
CLIENT_CHECK=${CLIENT_CHECK:-1}  # 0: skip the client check (CLIENT_PROCS, default 4, then sets the processes)

# ---- the load generator alone, against the fake upstream (no engine): tok/s and its CPU per token -------------
[ "$CLIENT_CHECK" = 1 ] && {
$PY -m shardserve.bench.serve_fake --port 0 > "$WORK/fake.log" 2>&1 &
FAKE=$!
for _ in $(seq 100); do grep -q "serving on" "$WORK/fake.log" && break; sleep 0.2; done
FAKE_ADDR=$(sed -n 's/.*serving on \([^ ]*\).*/\1/p' "$WORK/fake.log" | head -1)
if [ -n "$FAKE_ADDR" ]; then
  say "client check against the fake upstream at $FAKE_ADDR"
  timeout -k 5 60 $PY -m shardserve.bench.scaling_client --address "$FAKE_ADDR" --procs $CHECK_PROCS $CHECK \
    > "$OUT/client_check.txt" 2>&1
  cat "$OUT/client_check.txt" | tee -a "$LOG"
else
  say "the fake upstream did not start: $(tail -3 "$WORK/fake.log")"
fi
kill "$FAKE" 2> /dev/null; wait "$FAKE" 2> /dev/null
}
# the benchmark's client processes: the count that read the most from the fake upstream (one Python gRPC server
# process, as the controller's is), else CLIENT_PROCS (default 4)
BEST=$(sed -n 's/^\([0-9]*\) client process(es): \([0-9,]*\) output.*/\2 \1/p' "$OUT/client_check.txt" 2> /dev/null \
       | tr -d , | sort -n | tail -1 | cut -d' ' -f2)
CLIENT_PROCS=${CLIENT_PROCS:-${BEST:-4}}
say "client processes: $CLIENT_PROCS"

# ---- the scaling runs, one model after the other (each uses both GPUs); with EXTRA_B, each model once more ----
scaling_pass() {  # $1: the out-dir suffix, $2: more flags
  for model in $MODELS; do
    left=$(( BUDGET_S - $(elapsed) - 10 ))
    limit=${LIMIT[$model]}; (( limit > left )) && limit=$left
    if (( limit < 60 )); then say "$model$1: skipped (${left}s of the budget left)"; continue; fi
    CMD="$PY -m shardserve.cli.main bench scaling --model ${NAME[$model]} $DEV --ray-address $RAY_ADDRESS_ARG
         --placement spread --configs $CONFIGS --shared-configs 1x1,2x1 --routing cache-aware,round-robin
         --shared-kv-blocks $KV_BLOCKS $LOAD --client-procs $CLIENT_PROCS --out-dir $OUT/scaling_$model$1 $2"
    say "$model$1: start (limit ${limit}s): $(echo $CMD)"
    t0=$(date +%s)
    timeout -k 15 "$limit" $CMD > "$OUT/scaling_$model$1.txt" 2>&1
    rc=$?
    say "$model$1: exit $rc after $(( $(date +%s) - t0 ))s"
    grep -v "scaling:.*req/s\]\?$" "$OUT/scaling_$model$1.txt" | tail -40 >> "$LOG"
  done
}
scaling_pass "" "${EXTRA:-}"
[ -n "${EXTRA_B:-}" ] && scaling_pass _b "${EXTRA:-} $EXTRA_B"

[ "$SMOKE" != 1 ] && $PY -c "$RAY_CLI" stop --force >> "$LOG" 2>&1

# ---- summary ---------------------------------------------------------------------------------------------------
{
  cat "$OUT/client_check.txt" 2> /dev/null
  $PY - "$OUT" $MODELS <<'EOF'
import json, os, sys
out = sys.argv[1]
for model in [m + b for m in sys.argv[2:] for b in ("", "_b")]:
    path = os.path.join(out, f"scaling_{model}", "scaling.json")
    if model.endswith("_b") and not os.path.isdir(os.path.dirname(path)):
        continue
    if not os.path.exists(path):
        print(f"{model}: no records")
        continue
    records = json.load(open(path))
    print(f"{model}:")
    for r in records:
        w, n = r["workload"], r["notes"]
        cp = r.get("control_plane_share")
        hit = "-" if n.get("cache_hit_rate") is None else format(n["cache_hit_rate"], ".3f")
        print(f"  {r['replicas']}x{r['tp']} {w['kind']:<13} {w['routing']:<11} kv={w.get('kv_blocks_per_replica')} "
              f"{r['output_tokens_per_s']:9.0f} tok/s  x{r['speedup_vs_1']:.2f}  hit={hit}  "
              f"same-tokens={n.get('outputs_match_fraction')}  "
              f"control-plane={'-' if cp is None else format(cp, '.1%')}  client-max={n['client_cpu_max']:.0%}  "
              f"start={n['start_s']:.0f}s")
    shared = {(r["replicas"], r["workload"]["routing"]): r for r in records
              if r["workload"]["kind"] == "shared-prefix" and r["replicas"] == 2}
    if (2, "cache-aware") in shared and (2, "round-robin") in shared:
        ca, rr = shared[2, "cache-aware"], shared[2, "round-robin"]
        print(f"  cache-aware / round-robin at 2x1: {ca['output_tokens_per_s'] / rr['output_tokens_per_s']:.2f}x")
EOF
  echo "total: $(elapsed)s of a ${BUDGET_S}s budget; outputs in $OUT"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt" | tee -a "$LOG"
rm -rf "$WORK"
