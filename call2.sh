export TRITON_CACHE_DIR=/tmp/tc SHARDSERVE_COMMIT=${C:-dev}
mkdir -p $OUT/w
ONLY=none BUDGET_S=60 OUT=$OUT/w/setup bash bench/gpu_run.sh > /dev/null 2>&1
tail -2 $OUT/w/setup/log.txt
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "== kernel tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py tests/kernels/test_fp8_kv.py -k "even_splits or longest_first or split_k" 2>&1 | tail -2
echo "== ragged"; timeout 240 python3 -m shardserve.bench.attention_rates --model qwen3-0.6b --shapes "" --ragged 64x100-4096,32x100-4096,64x100-2048,128x100-2048,32x256-4096 --json-out $OUT/ragged.json 2>&1 | grep -v Warning | tail -12
W=$OUT/off; mkdir -p $W
off() { # NAME ENV...
  local name=$1; shift
  env "$@" ONLY="offline_qwen3 offline_qwen3_fp8" BUDGET_S=150 OUT=$W/$name bash bench/gpu_run.sh > /dev/null 2>&1
  for f in $W/$name/results.jsonl; do python3 - "$f" "$name" <<'PY'
import json, sys
for line in open(sys.argv[1]).read().splitlines():
    r = json.loads(line); p = r["notes"].get("phases", {})
    by = {k: round(v["ms_per_step"], 2) for k, v in p.get("decode_by_batch", {}).items()}
    print(f"{sys.argv[2]} {r['step']}: {r['output_tokens_per_s']:.0f} out tok/s, decode-only {p.get('decode_s', 0):.3f} s, prefill steps {p.get('prefill_s', 0):.3f} s, {by}")
PY
  done
}
for cfg in ${CFGS:-default even even1056}; do
  case $cfg in
    default) off default-$RUN X=1 ;;
    even) off even-$RUN SHARDSERVE_DECODE_EVEN_SPLITS=1 ;;
    even1056) off even1056-$RUN SHARDSERVE_DECODE_EVEN_SPLITS=1 SHARDSERVE_DECODE_PROGRAMS=1056 ;;
  esac
done
tar -C $W -czf $OUT/off.tgz . && rm -rf $W
