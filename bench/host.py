"""`shardserve bench host`: the host work of a step without a model, the part that must stay shorter than the
device's step for a GPU to stay busy.

The real Engine (scheduler, block manager, stop checks, deltas; the model's tokenizer detokenizing with
--detokenize) drives an executor that runs the worker's real InputBatch.prepare (deltas applied, the step's host
list built, block-table writes staged and listed) and answers every sampling row at once: its request's prompt
again, token by token (words of the vocabulary, as text would be, for the detokenizer). What
is left out is everything on the device side of the worker: launches, copies, sampling. The workload is the
offline benchmark's (random prompts, ignore_eos). Prints ms a step overall and by decode batch range.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from shardserve.bench.record import BenchRecord
from shardserve.bench.workload import parse_range, random_workload
from shardserve.proto.plan import StepPlan, StepResult, cdiv


class HostOnlyExecutor:
    """Runs each plan through InputBatch.prepare (and lists the block-table writes the device would get) and answers
    at once; times the worker's part of each step."""

    def __init__(self, block_size: int, num_kv_blocks: int, max_seqs: int, max_blocks: int) -> None:
        from shardserve.worker.input_batch import InputBatch

        self.num_kv_blocks = num_kv_blocks
        self.batch = InputBatch(block_size, max_seqs, max_blocks)
        self.results: deque[StepResult] = deque()
        self.worker_s = 0.0
        self.last_batch = 0  # requests in the last plan

    def submit(self, plan: StepPlan) -> None:
        started = time.perf_counter()
        self.last_batch = len(plan.req_ids)
        batch = self.batch.prepare(plan)
        self.batch.tables.take_writes()  # what flush() would copy to the device
        req_ids = [plan.req_ids[i] for i in batch.sample_rows]
        tokens = []
        for state in batch.sampling_states:
            tokens.append(state.token_ids[len(state.token_ids) % state.num_prompt_tokens])
            state.token_ids.append(tokens[-1])
        self.worker_s += time.perf_counter() - started
        self.results.append(StepResult(plan.step_id, req_ids=req_ids, token_ids=tokens, logprobs=[None] * len(req_ids)))

    def collect(self) -> StepResult:
        return self.results.popleft()

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.collect()

    def shutdown(self) -> None:
        pass


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.cluster.engine import Engine
    from shardserve.cluster.sampling_params import SamplingParams
    from shardserve.settings.resolve import build_engine_config, read_model_facts
    from shardserve.settings.engine_factory import load_tokenizer

    config = build_engine_config(**engine_kwargs)
    facts = read_model_facts(config.model)
    workload = random_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                               facts.vocab_size, seed=args.seed)
    bs = config.block_size
    blocks = sum(cdiv(len(p) + n, bs) for p, n in zip(workload.prompts, workload.output_lens)) + 1
    executor = HostOnlyExecutor(bs, blocks, config.max_num_seqs, cdiv(config.max_model_len, bs))
    tokenizer = load_tokenizer(config) if args.detokenize else None
    if args.detokenize and tokenizer is None:
        raise ValueError("--detokenize needs a model with a tokenizer")
    engine = Engine(config, executor, tokenizer, [], vocab_size=facts.vocab_size)
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.admit(f"host-{i}", list(prompt), SamplingParams(temperature=args.temperature, max_tokens=n,
                                                                     ignore_eos=True, seed=i,
                                                                     final_only=args.final_only))
    steps: list[tuple[int, float, float]] = []  # (the step's plan's requests, ms, the worker's ms)
    tokens = 0
    started = time.perf_counter()
    most_steps = workload.num_prompt_tokens + workload.num_output_tokens  # every step computes a token at least
    while engine.has_unfinished():
        if len(steps) > most_steps:
            raise RuntimeError(f"the engine made no progress in {most_steps} steps")
        t0, worker_before = time.perf_counter(), executor.worker_s
        tokens += sum(len(d.token_ids) for d in engine.step())
        steps.append((executor.last_batch, (time.perf_counter() - t0) * 1e3, (executor.worker_s - worker_before) * 1e3))
    elapsed = time.perf_counter() - started
    by_batch = _by_batch(steps)
    print(f"host only: {len(steps)} steps, {tokens} output tokens in {elapsed:.2f} s: {elapsed / len(steps) * 1e3:.3f} ms "
          f"a step (the worker's input preparation {executor.worker_s / len(steps) * 1e3:.3f}), "
          f"{elapsed / max(tokens, 1) * 1e6:.2f} us an output token; detokenize {'on' if tokenizer else 'off'}")
    print("ms a step by batch, all / the worker's: " + ", ".join(
        f"{k}: {v['ms_per_step']:.3f} / {v['worker_ms_per_step']:.3f} ({v['steps']})" for k, v in by_batch.items()))
    record = BenchRecord.for_engine(
        "host", args.model, config,
        workload=dict(num_prompts=len(workload.prompts), input_len=args.input_len, output_len=args.output_len,
                      temperature=args.temperature, ignore_eos=True, detokenize=bool(tokenizer),
                      final_only=args.final_only),
        output_tokens_per_s=tokens / elapsed)
    record.notes.update(steps=len(steps), output_tokens=tokens, elapsed_s=elapsed,
                        ms_per_step=elapsed / len(steps) * 1e3, worker_ms_per_step=executor.worker_s / len(steps) * 1e3,
                        by_batch=by_batch)
    record.write(args.json_out)
    return 0


def _by_batch(steps: list[tuple[int, float, float]]) -> dict:
    """Steps grouped by their plan's requests (powers of two), largest first: ms a step, all and the worker's."""
    groups: dict[int, list[tuple[float, float]]] = {}
    for batch, ms, worker_ms in steps:
        low = 1 << max(batch, 1).bit_length() - 1
        groups.setdefault(low, []).append((ms, worker_ms))
    return {f"{low}-{2 * low - 1}": dict(steps=len(g), ms_per_step=sum(m for m, _ in g) / len(g),
                                         worker_ms_per_step=sum(w for _, w in g) / len(g))
            for low, g in sorted(groups.items(), reverse=True)}


def add_host_parser(kinds, add_engine_args, run) -> None:
    host = kinds.add_parser("host", help="the engine's and the worker's host work a step, without a model")
    add_engine_args(host)
    host.add_argument("--num-prompts", type=int, default=256, help="how many random prompts")
    host.add_argument("--input-len", default="100-1024", help="N or LOW-HIGH (uniform)")
    host.add_argument("--output-len", default="100-1024", help="N or LOW-HIGH (uniform)")
    host.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of every request")
    host.add_argument("--detokenize", action="store_true", help="detokenize every token with the model's tokenizer")
    host.add_argument("--final-only", action="store_true",
                      help="requests answered in one delta at their end (as LLM.generate makes them), not per token")
    host.add_argument("--json-out", default=None, help="append the result as a JSON record to this file")
    host.set_defaults(func=run)
