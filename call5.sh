export TRITON_CACHE_DIR=/tmp/tc SHARDSERVE_COMMIT=535c890
W=$(mktemp -d); mkdir -p $W/r
run() { # NAME ENV
  env "$2" ONLY="offline_qwen3 offline_qwen3_fp8" BUDGET_S=150 OUT=$W/r/$1 bash bench/gpu_run.sh > /dev/null 2>&1
  echo "== $1 ($2)"; grep "out tok/s" $W/r/$1/summary.txt | cut -c1-90
}
run auto SHARDSERVE_DECODE_ORDER=auto
run batch SHARDSERVE_DECODE_ORDER=batch
tar -C $W -czf $OUT/r.tgz r
