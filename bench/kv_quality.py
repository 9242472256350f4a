"""`shardserve bench kv-quality`: what the FP8 KV cache (`--fp8 kv`, the default), FP8 weights (`--fp8 weights`:
quantization="fp8") or both do to a model's outputs, against the model's dtype, on a fixed prompt set.

- Greedy agreement, free-running: each prompt generates --max-tokens greedy tokens with each cache; reported are
  the share of prompts whose tokens are all equal and the mean share of tokens before the first difference.
- Next-token divergence, teacher-forced: with each cache the prompts go through one prefill step, then the
  reference's greedy tokens one decode step at a time (all prompts batched), so every generated position is
  computed by the decode path generation uses (the decode kernel and its FP8 loop); at each generated position
  KL(p_reference || p_fp8) over the full vocabulary, in float64. Mean, p99 and max over positions, and the top-1
  agreement at those positions.

With a tokenizer the prompts are PROMPTS (English, code, chat-like, numbers); with dummy weights, random token ids.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random

import torch

from shardserve.bench.record import BenchRecord

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away, there lived",
    "The three laws of thermodynamics state that",
    "Q: What is 17 times 23?\nA:",
    "import numpy as np\n\ndef normalize(x):\n",
    "Write a short poem about the sea.\n",
    "The mitochondria is the powerhouse of the cell because",
    "List of prime numbers: 2, 3, 5, 7, 11,",
    "In 1969, the Apollo 11 mission",
    "User: How do I reverse a list in Python?\nAssistant:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
    "Photosynthesis converts sunlight into",
    "A recipe for pancakes: first, mix",
    "The difference between TCP and UDP is that",
]


def prompt_ids(llm, num_prompts: int, seed: int = 0) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    if tokenizer is not None:
        return [tokenizer.encode(p) for p in (PROMPTS * (1 + num_prompts // len(PROMPTS)))[:num_prompts]]
    from shardserve.settings.resolve import read_model_facts

    high = min(read_model_facts(llm.config.model).vocab_size, 30000)
    rng = random.Random(seed)
    return [[rng.randrange(high // 10, high) for _ in range(rng.randint(16, 64))] for _ in range(num_prompts)]


@torch.inference_mode()
def teacher_forced_logprobs(runner, sequences: list[list[int]], firsts: list[int]) -> list[torch.Tensor]:
    """Per sequence, log-softmax (float64, on the CPU) of the next-token distribution at positions first-1 .. len-2,
    computed as generation computes them: every prompt in one prefill step, then the given tokens one decode step
    at a time, all sequences batched (decode-only steps: the decode kernel, as in generation). The engine is idle:
    its blocks are free."""
    from shardserve.proto.plan import NewRequest, SamplingSpec, StepPlan, cdiv
    from shardserve.worker.input_batch import InputBatch

    batch, ids, step = InputBatch(runner.block_size), [f"kl{i}" for i in range(len(sequences))], 1
    new, next_block = [], 0
    for req_id, seq in zip(ids, sequences):
        blocks = list(range(next_block, next_block + cdiv(len(seq), runner.block_size)))
        next_block += len(blocks)
        new.append(NewRequest(req_id, seq, len(seq), 0, blocks, SamplingSpec()))
    rows: list[list[torch.Tensor]] = [[] for _ in sequences]

    def forward(plan: StepPlan, last_rows: list[int]) -> torch.Tensor:
        input_ids, positions, meta = batch.prepare(plan).to_device(runner.device)
        hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
        return torch.log_softmax(runner.model.compute_logits(hidden[last_rows]).double(), -1).cpu()

    ends = [n - 1 for n in itertools.accumulate(firsts)]  # each prompt's last row in the packed prefill
    for i, lp in enumerate(forward(StepPlan(step, new_requests=new, req_ids=ids, num_tokens=firsts), ends)):
        rows[i].append(lp)
    for offset in range(max(len(s) - f for s, f in zip(sequences, firsts)) - 1):
        live = [i for i, (s, f) in enumerate(zip(sequences, firsts)) if f + offset < len(s) - 1]
        step += 1
        plan = StepPlan(step, req_ids=[ids[i] for i in live], num_tokens=[1] * len(live))
        for i, lp in zip(live, forward(plan, list(range(len(live))))):
            rows[i].append(lp)
    return [torch.stack(r) for r in rows]


def run_cache(engine_kwargs: dict, kv_cache_dtype: str, prompts, max_tokens: int, reference=None, num_prompts=16):
    """Greedy tokens of every prompt, and the teacher-forced log-probs over (prompt + reference tokens)."""
    from shardserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs, kv_cache_dtype=kv_cache_dtype)
    try:
        prompts = prompts if prompts is not None else prompt_ids(llm, num_prompts)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        forced = reference if reference is not None else tokens
        runner = llm.executor.runner
        logprobs = teacher_forced_logprobs(runner, [p + t for p, t in zip(prompts, forced)], [len(p) for p in prompts])
        resolved = runner.config.kv_cache_dtype
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return prompts, tokens, logprobs, resolved


def compare(ref_tokens, fp8_tokens, ref_logprobs, fp8_logprobs) -> dict:
    prefix = []
    for a, b in zip(ref_tokens, fp8_tokens):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(same / len(a))
    kl = torch.cat([(r.exp() * (r - f)).sum(-1) for r, f in zip(ref_logprobs, fp8_logprobs)])
    top1 = torch.cat([r.argmax(-1) == f.argmax(-1) for r, f in zip(ref_logprobs, fp8_logprobs)])
    ordered = kl.sort().values
    return dict(
        prompts=len(ref_tokens), positions=int(kl.numel()),
        greedy_all_equal=sum(p == 1.0 for p in prefix) / len(prefix),
        greedy_mean_prefix_share=sum(prefix) / len(prefix),
        kl_mean=float(kl.mean()), kl_p99=float(ordered[int(0.99 * (len(ordered) - 1))]), kl_max=float(kl.max()),
        teacher_forced_top1_agreement=float(top1.double().mean()),
    )


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.settings.resolve import build_engine_config

    engine_kwargs = {k: v for k, v in engine_kwargs.items() if k not in ("kv_cache_dtype", "quantization")}
    engine_kwargs.setdefault("max_num_seqs", args.num_prompts)
    fp8 = args.fp8
    compared_kv = "fp8" if fp8 in ("kv", "both") else "auto"
    compared = dict(engine_kwargs, quantization="fp8" if fp8 in ("weights", "both") else "none")
    prompts, ref_tokens, ref_lp, ref_name = run_cache(engine_kwargs, "auto", None, args.max_tokens,
                                                      num_prompts=args.num_prompts)
    _, fp8_tokens, fp8_lp, _ = run_cache(compared, compared_kv, prompts, args.max_tokens, reference=ref_tokens)
    result = compare(ref_tokens, fp8_tokens, ref_lp, fp8_lp)
    what = {"kv": "fp8 cache", "weights": "fp8 weights", "both": "fp8 weights and cache"}[fp8]
    print(f"{what} vs {ref_name} over {result['prompts']} prompts x {args.max_tokens} greedy tokens: "
          f"all tokens equal on {result['greedy_all_equal']:.0%} of prompts, mean share before the first difference "
          f"{result['greedy_mean_prefix_share']:.1%}; teacher-forced over {result['positions']} positions: mean KL "
          f"{result['kl_mean']:.2e} nats (p99 {result['kl_p99']:.2e}, max {result['kl_max']:.2e}), top-1 agreement "
          f"{result['teacher_forced_top1_agreement']:.2%}", flush=True)
    config = build_engine_config(**compared, kv_cache_dtype=compared_kv)
    record = BenchRecord.for_engine("kv_quality", args.model, config,
                                    workload=dict(num_prompts=args.num_prompts, output_len=args.max_tokens,
                                                  temperature=0.0, reference_kv_cache_dtype=ref_name,
                                                  reference_quantization="none"))
    record.notes.update(result)
    record.write(args.json_out)
    return 0
