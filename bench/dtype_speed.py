"""float32 against bfloat16 on this CPU: the default model loaded in both dtypes in one process, the same greedy
workload run on each in turn (alternating which goes first each round), each run timed in process CPU seconds (every
thread) and wall seconds. On a shared, oversubscribed machine the CPU seconds measure the work each path does; the
wall seconds measure the machine's load as much.

    python -m shardserve.bench.dtype_speed --num-prompts 8 --input-len 16-256 --output-len 32 --rounds 2 --json-out r.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    from shardserve import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", default="16-256", help="LOW-HIGH random prompt tokens (uniform)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    low, high = (int(x) for x in args.input_len.split("-"))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(low, high))] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = {d: LLM(dtype=d, device="cpu", seed=0) for d in ("float32", "bfloat16")}
    for llm in engines.values():  # warm-up: kernels built, packed weights made
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    runs = []
    for r in range(args.rounds):
        for d in ("float32", "bfloat16") if r % 2 == 0 else ("bfloat16", "float32"):
            cpu, wall = time.process_time(), time.perf_counter()
            out = engines[d].generate(prompts, params, use_tqdm=False)
            runs.append(dict(round=r, dtype=d, cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - wall,
                             output_tokens=sum(len(o.outputs[0].token_ids) for o in out),
                             load_average=float(open("/proc/loadavg").read().split()[0])))
            print(json.dumps(runs[-1]), flush=True)
    cpu = {d: statistics.median(r["cpu_s"] for r in runs if r["dtype"] == d) for d in engines}
    summary = dict(cpu_s_median=cpu, float32_over_bfloat16_cpu=cpu["float32"] / cpu["bfloat16"])
    print(json.dumps(summary), flush=True)
    for llm in engines.values():
        llm.shutdown()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(benchmark="dtype_speed", workload=vars(args), runs=runs, **summary), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
