"""FP8 weights (quantization="fp8") on the default model at TP=3 over gloo, the demo's shape: the setting crosses
the wire to every rank's process (EngineConfig.quantization), each rank quantizes its own shards (row-parallel
layers: a scale per output channel over the rank's slice of the inputs, and the activations per token over that
slice), and the outputs stay near the unquantized model's. Measured through prompt logprobs (every prompt token's
log-probability, teacher-forced by the prompt itself), 3 prompts, 68 positions, on 2026-12-03: mean |difference|
against the unquantized model 0.146 nats at TP=1 and 0.240 at TP=3 (0.214 between the two); unquantized TP=3
against TP=1 differ by float32 rounding alone (mean 4.6e-6, max 2.3e-5)."""

from __future__ import annotations

import statistics

from shardserve import LLM, SamplingParams

PROMPTS = ["The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
           "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker."]
MEAN_BOUND = 0.5  # ~2x the TP=3 measurement


def prompt_logprobs(model_dir: str, **settings) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with LLM(model=model_dir, max_model_len=256, **settings) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [next(iter(entry.values())).logprob for out in outputs for entry in out.prompt_logprobs[1:]]


def test_fp8_weights_at_tp3_quantize_every_ranks_shards_and_stay_near_the_model(default_model_dir):
    reference = prompt_logprobs(default_model_dir)
    quantized = prompt_logprobs(default_model_dir, quantization="fp8", tensor_parallel_size=3)
    assert len(quantized) == len(reference) == 68
    mean = statistics.mean(abs(a - b) for a, b in zip(quantized, reference))
    assert 1e-3 < mean < MEAN_BOUND, mean  # (above 1e-3: the ranks really ran FP8 weights)
