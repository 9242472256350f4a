"""Picks each request's next token from the model's logits: penalties, min_tokens, greedy or seeded sampling, logprobs.

Design decision: randomness is a pure function of (seed, index of the token being generated).
Each sampled row hashes its (seed, index) with splitmix64 into a 64-bit key. On CPU the key gives one uniform u in
(0, 1) and the row takes the first token whose cumulative probability reaches u (inverse-CDF sampling: token i
comes out with probability probs[i], and a token with probability 0 never does); one draw per row, because a draw
per vocabulary entry cost ~40 ms a step on CPU at batch 32. On CUDA a Triton kernel hashes the key with each token
index into Gumbel noise and takes the argmax (kernels/sampling.py): one pass over the logits instead of softmax,
a float64 cumulative sum and a search (that torch path took 1.36 ms a step at batch 256 x 152k vocabulary on an
H200). Both draw exactly from the filtered softmax; they are different draws, so the same seed gives
different (equally distributed) tokens on CPU and on GPU. No generator state, so:
- a request's tokens do not depend on what else is in the batch or on its row order;
- after a preemption the request resumes with the same draws (the index is the number of tokens it generated
  before, which the resumed request carries);
- every tensor-parallel rank holds the full logits and computes the same draws, so all ranks sample the same token
  with no broadcast of sampled tokens. (This relies on the all-reduce and all-gather leaving bitwise-identical
  tensors on every rank, which ring/tree collectives in gloo and NCCL do: each rank ends with the same copies.)

Order of transforms (vLLM/HF semantics): logit_bias (added), repetition penalty (prompt + generated tokens),
presence/frequency penalties (generated tokens), min_tokens (stop ids masked), then greedy rows take the argmax;
sampled rows apply temperature, top-k, top-p, min-p and the draw. Logprobs come from the raw logits, before any of
this.

Where each job lives: sampling_row.py (a row's settings and tokens), logit_processors.py (bias, penalties,
min_tokens), logit_filter.py (top-k, top-p, min-p), cpu_draw.py and gpu_draw.py (the two draws), token_logprobs.py,
sampler_warm_up.py (compiling the GPU kernels at start-up); this module puts them in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.proto.plan import TokenLogprobs
from shardserve.worker.cpu_draw import draw_rows_cpu
from shardserve.worker.device_copy import device_tensor
from shardserve.worker.gpu_draw import draw_rows_gumbel
from shardserve.worker.logit_processors import process_logits
from shardserve.worker.sampling_row import SamplingRow
from shardserve.worker.token_logprobs import token_logprobs


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """logits: [N, V] (full vocabulary, any float dtype), one row per SamplingRow. Returns one token (and logprobs)
    per row."""
    tokens = sample_tokens(logits, rows)
    return SamplerOutput(token_ids=tokens.tolist(), logprobs=token_logprobs(logits, rows, tokens))


@torch.inference_mode()
def sample_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """sample() without reading back: [N] int64 token ids on the logits' device (async scheduling feeds them to
    the next step there). Leaves `logits` unchanged, so token_logprobs can read them afterwards."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    logits = process_logits(logits, rows)  # bias, penalties and min_tokens (on a float32 copy where any applies)
    sampled = [i for i, r in enumerate(rows) if r.spec.temperature > 0.0]
    if len(sampled) == len(rows):
        tokens = draw_rows(logits, rows)
    else:
        tokens = greedy(logits)
        if sampled:
            idx = device_tensor(sampled, torch.int64, logits.device)
            tokens[idx] = draw_rows(logits[idx], [rows[i] for i in sampled])
    return tokens


def draw_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The seeded draw of rows with a temperature: [n] int64 token ids (Gumbel-max on CUDA, inverse CDF on CPU)."""
    return draw_rows_gumbel(logits, rows) if logits.is_cuda else draw_rows_cpu(logits, rows)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[n] int64: each row's argmax (the first index of its largest value, as torch.argmax). On the CPU through
    torch.max, whose indices are the same and which runs several times faster on bfloat16 logits."""
    if logits.device.type == "cpu":
        return torch.max(logits, dim=1).indices
    return torch.argmax(logits, dim=1)
