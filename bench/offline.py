"""`shardserve bench offline`: output tokens/s of a whole batch of random prompts, optionally against transformers."""

from __future__ import annotations

import argparse
import gc
import time

from shardserve.bench.record import BenchRecord, device_name
from shardserve.bench.workload import Workload, parse_range, random_workload


def peak_memory_gb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB; includes child-free peak


def run_shardserve(llm, workload: Workload, temperature: float) -> tuple[float, int]:
    from shardserve import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(workload.output_lens)]
    llm.generate(workload.prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    return elapsed, produced


def run_hf_padded(model_dir: str, workload: Workload, temperature: float, dtype: str, device: str,
                  load_format: str) -> tuple[float, int]:
    """transformers' generate on the same prompts, one padded batch (left padding), fixed output length."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if load_format == "dummy":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), torch_dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch_dtype, local_files_only=True)
    model = model.to(device).eval()
    max_new = max(workload.output_lens)
    longest = max(len(p) for p in workload.prompts)
    pad = 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in workload.prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in workload.prompts], device=device)
    sample = dict(do_sample=temperature > 0, temperature=temperature or None, top_k=None, top_p=None)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=pad, **sample)
        elapsed = time.perf_counter() - start
    produced = (out.shape[1] - longest) * out.shape[0]
    del model
    gc.collect()
    return elapsed, produced


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve import LLM

    llm = LLM(**engine_kwargs)
    cfg = llm.config
    facts_vocab = llm.engine.vocab_size
    workload = random_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                               facts_vocab, seed=args.seed)
    if args.compare == "hf":  # fixed output length: padded generate cannot stop rows early
        workload.output_lens = [max(workload.output_lens)] * len(workload.prompts)
    print(f"workload: {len(workload.prompts)} prompts, {workload.num_prompt_tokens} prompt tokens, "
          f"{workload.num_output_tokens} output tokens; device {cfg.device}, dtype {cfg.dtype}, tp {cfg.tensor_parallel_size}")
    elapsed, produced = run_shardserve(llm, workload, args.temperature)
    tok_s = produced / elapsed
    record = BenchRecord(
        benchmark="offline", model=args.model or "SmolLM2-135M-Instruct", load_format=cfg.load_format,
        device=device_name(cfg.device), num_gpus=cfg.tensor_parallel_size if cfg.device == "cuda" else 0,
        tp=cfg.tensor_parallel_size, replicas=1,
        workload=dict(num_prompts=len(workload.prompts), input_len=args.input_len, output_len=args.output_len,
                      temperature=args.temperature),
        output_tokens_per_s=tok_s,
        total_tokens_per_s=(produced + workload.num_prompt_tokens) / elapsed,
    )
    print(f"shardserve: {produced} tokens in {elapsed:.2f} s = {tok_s:.1f} output tok/s")
    llm.shutdown()
    if args.compare == "hf":
        import torch

        sample = Workload(workload.prompts[: args.hf_prompts], workload.output_lens[: args.hf_prompts])
        hf_elapsed, hf_produced = run_hf_padded(cfg.model, sample, args.temperature, cfg.dtype, cfg.device,
                                                cfg.load_format)
        hf_tok_s = hf_produced / hf_elapsed
        record.ratio_vs_hf = tok_s / hf_tok_s
        record.notes["hf_output_tokens_per_s"] = hf_tok_s
        record.notes["hf_prompts"] = len(sample.prompts)
        record.notes["threads"] = torch.get_num_threads()
        print(f"transformers (padded batch of {len(sample.prompts)}): {hf_produced} tokens in {hf_elapsed:.2f} s "
              f"= {hf_tok_s:.1f} output tok/s; shardserve / transformers = {record.ratio_vs_hf:.2f}x")
    record.peak_memory_gb = peak_memory_gb(cfg.device)
    print(f"peak memory: {record.peak_memory_gb:.2f} GiB")
    record.write(args.json_out)
    return 0
