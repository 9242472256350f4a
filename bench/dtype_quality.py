"""`python -m shardserve.bench.dtype_quality`: what running the model in another dtype (bfloat16 on CPU) does to
its outputs, against float32, with the measures of `bench kv-quality` (bench/kv_quality.py): free-running greedy
agreement and the teacher-forced next-token KL(float32 || other) on its fixed prompt set.

    python -m shardserve.bench.dtype_quality [--model M] [--dtype bfloat16] [--num-prompts 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json

from shardserve.bench.kv_quality import compare, run_cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as for `shardserve bench` (default: the default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", help="the dtype compared with float32")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    common = dict(device=args.device, max_num_seqs=args.num_prompts)
    if args.model:
        common["model"] = args.model
    prompts, ref_tokens, ref_lp, _ = run_cache(dict(common, dtype="float32"), "auto", None, args.max_tokens,
                                               num_prompts=args.num_prompts)
    _, tokens, logprobs, _ = run_cache(dict(common, dtype=args.dtype), "auto", prompts, args.max_tokens,
                                       reference=ref_tokens)
    result = dict(compare(ref_tokens, tokens, ref_lp, logprobs), dtype=args.dtype, reference="float32",
                  max_tokens=args.max_tokens)
    print(json.dumps(result, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
