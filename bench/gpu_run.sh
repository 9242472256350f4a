#!/usr/bin/env bash
# The GPU run: GPU tests and every benchmark (docs/performance.md) on a 2x H200 host, within one time budget.
#
#   bash bench/gpu_run.sh                 # on the GPU host, from the project root; writes to $OUT (default ./gpu-out)
#   SMOKE=1 bash bench/gpu_run.sh         # on a CPU machine: the same commands on tiny models (checks the plumbing)
#
# The host has no package index: wheels in .whl/ (bash ../shared/tools/gpu-wheels.sh .whl) go to /tmp/site, the
# project is installed editable without fetching, or (if that fails) mapped by a sitecustomize shim.
# Output ($OUT, a few files): log.txt (every step's output), results.jsonl (one JSON record per benchmark),
# gpu_tests.txt (pytest -m gpu), env.txt (versions, nvidia-smi), summary.txt (the table printed at the end).
# SHARDSERVE_COMMIT=<hash> names the tree in the JSON records (the host's copy may carry a stale .git).
# Steps run in order of value, each with its own timeout, none stopping the others; single-GPU steps run in
# pairs, one per GPU. BUDGET_S (default 330) bounds the whole run: a step starts only with time left for it.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
PY=${PY:-python3}
SMOKE=${SMOKE:-0}
BUDGET_S=${BUDGET_S:-330}
PROFILE=${PROFILE:-0}  # 1: torch profiler tables of offline_qwen3 and latency_llama8b_tp1 in $OUT (slows those two runs)
REPEATS=${REPEATS:-3}  # timed runs of the Qwen3 offline workload on one engine; the record's figure is their median
ONLY=${ONLY:-}  # step names to run (space-separated); empty: every step
EXTRA_FLAGS=${EXTRA_FLAGS:-}  # engine flags added to every benchmark command (bench/offline_ab.sh's A/B runs)
START=$(date +%s)
WORK=$(mktemp -d /tmp/shardserve-gpu-run.XXXXXX)
mkdir -p "$OUT" "$WORK/json" "$WORK/logs"
LOG=$OUT/log.txt
: > "$LOG"
: > "$OUT/results.jsonl"
# NVLink multicast stays off in every process (the environment notes): exported, so children inherit it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # Ray on loopback only
export TRITON_INTERPRET=${TRITON_INTERPRET:-0}  # compiled kernels (tests/conftest.py sets 1 where it sees no GPU)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/shardserve-triton-cache}  # one cache: kernels compile once per run
[ "$SMOKE" = 1 ] && export TRITON_INTERPRET=1

say() { echo "[gpu_run $(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
elapsed() { echo $(( $(date +%s) - START )); }

# ---- setup ------------------------------------------------------------------------------------------------------
setup() {
  if [ "$SMOKE" != 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >> "$LOG" 2>&1 \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} && say "wheels from .whl/ installed in /tmp/site"
  fi
  local check="import shardserve.cluster.engine, shardserve.worker.cuda_graphs, shardserve.bench.offline"
  if ! (cd /tmp && $PY -c "$check") > /dev/null 2>&1 || ! $PY -c "$check" > /dev/null 2>&1; then
    if [ "$SMOKE" != 1 ]; then
      $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$LOG" 2>&1 \
        && say "project installed editable (pip -e, no index)"
    fi
  fi
  if ! (cd /tmp && $PY -c "$check") >> "$LOG" 2>&1 || ! $PY -c "$check" >> "$LOG" 2>&1; then
    # pyproject's package-dir mapping (shardserve.cluster -> cluster/, ...) as a meta-path finder loaded at start-up
    mkdir -p "$WORK/shim"
    cat > "$WORK/shim/sitecustomize.py" <<EOF
import importlib.abc, importlib.util, os, sys
_ROOT = "$ROOT"
_MAP = {"shardserve": "shardserve", "shardserve.cluster": "cluster", "shardserve.worker": "worker",
        "shardserve.worker.layers": "worker/layers", "shardserve.worker.models": "worker/models",
        "shardserve.kernels": "kernels", "shardserve.proto": "proto", "shardserve.bench": "bench"}
class _ShardserveFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _MAP:
            return None
        folder = os.path.join(_ROOT, _MAP[name])
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])
sys.meta_path.insert(0, _ShardserveFinder())
EOF
    export PYTHONPATH=$WORK/shim${PYTHONPATH:+:$PYTHONPATH}
    if (cd /tmp && $PY -c "$check") >> "$LOG" 2>&1; then say "project mapped by the sitecustomize shim"
    else say "WARNING: shardserve is not importable; the steps below will fail"; fi
  fi
}

environment() {
  {
    echo "date: $(date -u +%FT%TZ)  commit: ${SHARDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}  smoke: $SMOKE"
    $PY - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "transformers", "grpc", "google.protobuf", "ray", "numpy"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "NOT IMPORTABLE:", exc)
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda, "devices", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,name,memory.used,memory.total,clocks.sm --format=csv
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt" >> "$LOG"
}

# ---- steps ------------------------------------------------------------------------------------------------------
declare -A RC DT PIDS STARTED
ORDER=()

# start_step NAME LIMIT_S MIN_S GPUS CMD...: runs CMD in the background, if at least MIN_S of the budget is left
# (GPUS: CUDA_VISIBLE_DEVICES for the step, "all" = unchanged)
wanted() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }

# On a one-GPU host the steps meant for GPU 0 || GPU 1 run one after the other on GPU 0 (two-GPU steps still try).
NUM_GPUS=$( { command -v nvidia-smi > /dev/null && nvidia-smi -L 2> /dev/null | grep -c '^GPU'; } || echo 0)
SERIAL=0; [ "$SMOKE" != 1 ] && [ "$NUM_GPUS" = 1 ] && SERIAL=1

start_step() {
  local name=$1 limit=$2 min=$3 gpus=$4; shift 4
  [ "$SERIAL" = 1 ] && [ "$gpus" != all ] && gpus=0
  ORDER+=("$name")
  if ! wanted "$name"; then RC[$name]=not-run; DT[$name]=0; return; fi
  local left=$(( BUDGET_S - $(elapsed) ))
  if (( left < min )); then RC[$name]=skipped; DT[$name]=0; say "$name: skipped (${left}s of the budget left)"; return; fi
  (( limit > left )) && limit=$left
  say "$name: start (limit ${limit}s, GPUs $gpus): $*"
  STARTED[$name]=$(date +%s)
  (
    [ "$gpus" != all ] && [ "$SMOKE" != 1 ] && export CUDA_VISIBLE_DEVICES=$gpus
    exec timeout -k 15 "$limit" "$@"
  ) > "$WORK/logs/$name.log" 2>&1 &
  PIDS[$name]=$!
  [ "$SERIAL" = 1 ] && finish_step "$name"
}

finish_step() {
  local name=$1
  [ -z "${PIDS[$name]:-}" ] && return
  wait "${PIDS[$name]}"
  RC[$name]=$?
  DT[$name]=$(( $(date +%s) - STARTED[$name] ))
  unset "PIDS[$name]"
  { echo "===== $name: exit ${RC[$name]} after ${DT[$name]}s"; cat "$WORK/logs/$name.log"; echo; } >> "$LOG"
  [ "${RC[$name]}" = 124 ] && say "$name: TIMED OUT after ${DT[$name]}s" || say "$name: exit ${RC[$name]} after ${DT[$name]}s"
  if [ -f "$WORK/json/$name.json" ]; then
    $PY -c "import json,sys; r=json.load(open(sys.argv[1])); r['step']=sys.argv[2]; print(json.dumps(r))" \
      "$WORK/json/$name.json" "$name" >> "$OUT/results.jsonl"
  fi
}

bench() {  # bench NAME ARGS...: the shardserve bench command with its JSON record in $WORK/json/NAME.json
  local name=$1; shift
  echo "$PY -m shardserve.cli.main bench $* ${EXTRA_FLAGS:-} --json-out $WORK/json/$name.json"
}

setup
environment

if [ "$SMOKE" = 1 ]; then  # tiny models on CPU: the same commands, small enough for a 2-core machine
  $PY -c "
from tests.hf_reference import make_tiny_model
make_tiny_model('$WORK/small', 'qwen3', num_heads=4, num_kv_heads=2)
make_tiny_model('$WORK/big', 'llama', num_heads=4, num_kv_heads=2)" >> "$LOG" 2>&1
  SMALL=$WORK/small; BIG=$WORK/big
  DEV="--device cpu --num-kv-blocks 256 --load-format dummy"
  N_SMALL=6; N_BIG=4; N_HF=3; N_CP=4; LENS="8-24"; OLENS="4-12"; HF_OUT=8; LAT_IN=16; LAT_OUT=12; CP_OUT=8; CP_IN=16
  MML_OFF=256; MML_LAT=256
else
  SMALL=qwen3-0.6b; BIG=llama-3-8b
  DEV="--device cuda --load-format dummy"
  N_SMALL=256; N_BIG=${N_BIG:-256}; N_HF=${N_HF:-64}; N_CP=64; LENS="100-1024"; OLENS="100-1024"; HF_OUT=256
  LAT_IN=128; LAT_OUT=256; CP_OUT=64; CP_IN=128
  MML_OFF=2048; MML_LAT=1024  # the workload's longest sequence is 1024 + 1024
fi

# (p) where a step's time goes (bench probe: host, forward, LM head, sampling, prefill) [GPU 0 || GPU 1]
PROBE_LENS="--context-len 800 --max-model-len $MML_OFF"
[ "$SMOKE" = 1 ] && PROBE_LENS="--context-len 40 --max-model-len 256 --prefill-tokens 64 --prefill-seq-len 32 --repeats 4"
SWEEP=${SWEEP:-0}  # 1: the probes also sweep the decode kernel's launch settings (+ ~1-2 min)
SWEEP_SMALL=; SWEEP_BIG=; PROBE_LIMIT=150
[ "$SWEEP" = 1 ] && SWEEP_SMALL="--sweep-attention 256x800,64x1600" && SWEEP_BIG="--sweep-attention 1x384,64x800" \
  && PROBE_LIMIT=270
start_step probe_qwen3 $PROBE_LIMIT 60 0 $PY -m shardserve.cli.main bench probe --model $SMALL ${DEV/--num-kv-blocks 256/} \
  --batch-sizes 1,64,256 $PROBE_LENS $SWEEP_SMALL --json-out "$OUT/probe_qwen3.json"
start_step probe_llama8b $PROBE_LIMIT 60 1 $PY -m shardserve.cli.main bench probe --model $BIG ${DEV/--num-kv-blocks 256/} \
  --batch-sizes 1,64,128 $PROBE_LENS $SWEEP_BIG --json-out "$OUT/probe_llama8b.json"
finish_step probe_qwen3; finish_step probe_llama8b

# (b) offline Qwen3-0.6B, nano-vllm's workload [GPU 0]  ||  (c) latency Llama-3-8B TP=1 [GPU 1]
PROF_OFF=; PROF_LAT=
[ "$PROFILE" = 1 ] && PROF_OFF="--profile $OUT/profile_offline_qwen3.txt" && PROF_LAT="--profile $OUT/profile_latency_tp1.txt"
start_step offline_qwen3 120 40 0 $(bench offline_qwen3 offline --model $SMALL $DEV --num-prompts $N_SMALL --repeats $REPEATS \
  --input-len $LENS --output-len $OLENS --max-model-len $MML_OFF $PROF_OFF)
start_step latency_llama8b_tp1 90 30 1 $(bench latency_llama8b_tp1 latency --model $BIG $DEV --tp 1 \
  --input-len $LAT_IN --output-len $LAT_OUT --max-model-len $MML_LAT $PROF_LAT)
finish_step offline_qwen3; finish_step latency_llama8b_tp1

# (b2) offline Qwen3-0.6B with the FP8 KV cache [GPU 0]  ||  (b3) its attention kernels' bytes/s, bf16 and FP8, and
# where an FP8 step's time goes [GPU 1]
start_step offline_qwen3_fp8 120 40 0 $(bench offline_qwen3_fp8 offline --model $SMALL $DEV --kv-cache-dtype fp8 --repeats $REPEATS \
  --num-prompts $N_SMALL --input-len $LENS --output-len $OLENS --max-model-len $MML_OFF)
ATT_RATES="32x256,32x4096,64x1024,64x4096,256x800"; [ "$SMOKE" = 1 ] && ATT_RATES=""
start_step probe_qwen3_fp8 $PROBE_LIMIT 60 1 $PY -m shardserve.cli.main bench probe --model $SMALL \
  ${DEV/--num-kv-blocks 256/} --kv-cache-dtype fp8 --batch-sizes 64,256 $PROBE_LENS --prefill-tokens 0 \
  ${ATT_RATES:+--attention-rates $ATT_RATES} --json-out "$OUT/probe_qwen3_fp8.json"
finish_step offline_qwen3_fp8; finish_step probe_qwen3_fp8

# (b4) what the FP8 cache does to outputs (random weights here: greedy agreement and KL vs the bf16 cache) [GPU 0]
# ||  (b5) offline Llama-3-8B with the FP8 KV cache [GPU 1]
N_KVQ=32; KVQ_TOK=128; [ "$SMOKE" = 1 ] && N_KVQ=3 && KVQ_TOK=8
start_step kv_quality_qwen3 120 40 0 $(bench kv_quality_qwen3 kv-quality --model $SMALL $DEV \
  --num-prompts $N_KVQ --max-tokens $KVQ_TOK --max-model-len $MML_OFF)
start_step offline_llama8b_fp8 120 45 1 $(bench offline_llama8b_fp8 offline --model $BIG $DEV --kv-cache-dtype fp8 \
  --num-prompts $N_BIG --input-len $LENS --output-len $OLENS --max-model-len $MML_OFF)
finish_step kv_quality_qwen3; finish_step offline_llama8b_fp8

# (d) latency Llama-3-8B TP=2 [both GPUs]
start_step latency_llama8b_tp2 90 35 all $(bench latency_llama8b_tp2 latency --model $BIG $DEV --tp 2 \
  --input-len $LAT_IN --output-len $LAT_OUT --max-model-len $MML_LAT)
finish_step latency_llama8b_tp2

# (e) offline Llama-3-8B [GPU 0]  ||  (f) transformers' continuous batching vs ours on Qwen3-0.6B [GPU 1]
start_step offline_llama8b 120 45 0 $(bench offline_llama8b offline --model $BIG $DEV --num-prompts $N_BIG \
  --input-len $LENS --output-len $OLENS --max-model-len $MML_OFF)
start_step compare_hf_qwen3 120 45 1 $(bench compare_hf_qwen3 offline --model $SMALL $DEV --num-prompts $N_HF \
  --input-len $LENS --output-len $HF_OUT --max-model-len $MML_OFF --compare hf --hf-prompts $N_HF --no-roofline)
finish_step offline_llama8b; finish_step compare_hf_qwen3

# (e2) offline Llama-3-8B with FP8 weights (quantization=fp8: a quantized model, beside the bf16 figures) [GPU 0]
# ||  the same with the FP8 KV cache too [GPU 1]
start_step offline_llama8b_fp8w 120 45 0 $(bench offline_llama8b_fp8w offline --model $BIG $DEV --quantization fp8 \
  --num-prompts $N_BIG --input-len $LENS --output-len $OLENS --max-model-len $MML_OFF)
start_step offline_llama8b_fp8w_fp8 120 45 1 $(bench offline_llama8b_fp8w_fp8 offline --model $BIG $DEV \
  --quantization fp8 --kv-cache-dtype fp8 --num-prompts $N_BIG --input-len $LENS --output-len $OLENS \
  --max-model-len $MML_OFF)
finish_step offline_llama8b_fp8w; finish_step offline_llama8b_fp8w_fp8

# (g) control plane at TP=2, steady-state decode at batch 64: the Ray + gRPC cluster, then local processes
start_step control_plane_tp2 150 60 all $(bench control_plane_tp2 control-plane --model $BIG $DEV --tp 2 \
  --num-prompts $N_CP --input-len $CP_IN --output-len $CP_OUT --max-model-len $MML_LAT --max-num-seqs $N_CP \
  --executor both)
finish_step control_plane_tp2

# (a) GPU tests last (kernels were checked on the GPU before; the benchmarks come first): kernels, CUDA graphs vs
# eager (TP=1, TP=2), the graphs' memory reserve, with whatever budget is left
ORDER+=(gpu_tests)
GPU_TESTS_LIMIT=$(( BUDGET_S - $(elapsed) ))
if ! wanted gpu_tests; then
  RC[gpu_tests]=not-run; DT[gpu_tests]=0
elif (( GPU_TESTS_LIMIT < 30 )); then
  RC[gpu_tests]=skipped; DT[gpu_tests]=0; say "gpu_tests: skipped (${GPU_TESTS_LIMIT}s of the budget left)"
else
  (( GPU_TESTS_LIMIT > ${GPU_TESTS_MAX_S:-120} )) && GPU_TESTS_LIMIT=${GPU_TESTS_MAX_S:-120}
  STARTED[gpu_tests]=$(date +%s)
  say "gpu_tests: start (limit ${GPU_TESTS_LIMIT}s)"
  if command -v make > /dev/null; then
    timeout -k 10 $GPU_TESTS_LIMIT make test-gpu PY="$PY" SETUP= PYTEST_ARGS="-rfEs --durations=15" > "$OUT/gpu_tests.txt" 2>&1
  else
    timeout -k 10 $GPU_TESTS_LIMIT $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rfEs --durations=15 > "$OUT/gpu_tests.txt" 2>&1
  fi
  RC[gpu_tests]=$?; DT[gpu_tests]=$(( $(date +%s) - STARTED[gpu_tests] ))
  say "gpu_tests: exit ${RC[gpu_tests]} after ${DT[gpu_tests]}s ($(tail -1 "$OUT/gpu_tests.txt"))"
fi

# ---- summary ----------------------------------------------------------------------------------------------------
{
  printf "%-22s %-8s %6s\n" step exit seconds
  for name in "${ORDER[@]}"; do printf "%-22s %-8s %6s\n" "$name" "${RC[$name]:-?}" "${DT[$name]:-?}"; done
  echo
  $PY - "$OUT/results.jsonl" <<'EOF'
import json, sys
def fmt(x, spec):
    return "-" if x is None else format(x, spec)
for line in open(sys.argv[1]):
    r = json.loads(line)
    n = r.get("notes", {})
    parts = [f"{r['step']}: {r['model']} tp={r['tp']}"]
    if r.get("output_tokens_per_s") is not None and r["benchmark"] == "offline" and "measure" not in n:
        parts.append(f"{r['output_tokens_per_s']:.0f} out tok/s")
    if r.get("ceiling_output_tokens_per_s"):
        parts.append(f"ceiling {r['ceiling_output_tokens_per_s']:.0f} ({n.get('fraction_of_ceiling', 0):.1%})")
    if r.get("ms_per_token") is not None:
        parts.append(f"{r['ms_per_token']:.3f} ms/token, bound {fmt(n.get('weight_read_bound_ms'), '.3f')} ms")
    if r.get("ratio_vs_hf") is not None:
        parts.append(f"{r['ratio_vs_hf']:.1f}x transformers ({n['hf']['method']}: {n['hf']['output_tokens_per_s']:.0f} tok/s)")
    if n.get("cluster_to_local_throughput"):
        parts.append(f"cluster/local throughput {n['cluster_to_local_throughput']:.3f}x")
    if r.get("control_plane_share") is not None or "executors" in n:
        for name, e in n.get("executors", {}).items():
            parts.append(f"{name}: control plane {fmt(e.get('share'), '.1%')} "
                         f"(step {fmt(e.get('median_step_ms'), '.2f')} ms, worker {fmt(e.get('median_forward_ms'), '.2f')} ms)"
                         if "error" not in e else f"{name}: {e['error']}")
    if n.get("cuda_graphs"):
        parts.append(f"graphs: {n['cuda_graphs']}")
    print(" | ".join(parts))
EOF
  echo "total: $(elapsed)s of a ${BUDGET_S}s budget; outputs in $OUT"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt" | tee -a "$LOG"
rm -rf "$WORK"
