"""transformers as the baseline of `shardserve bench offline --compare hf`: its own continuous batching
(`model.generate_batch`, paged attention), or a padded `generate` where that is not usable.

generate_batch (transformers >= 5.x; the same call on 5.17 and 5.24) runs with its documented defaults, which are
its best settings without optional packages: attention "paged|sdpa" (flash-attn is not installed on our hosts; it
switches to flash itself where it is), CUDA graphs and async batching auto-detected, cache sized from free memory,
max_requests_per_batch and max_batch_tokens inferred from the workload. Its time is taken from its own request
timestamps (first request created -> last request finished), so its warm-up (graph capture) is not counted, as
ours is not; the whole call's time is kept beside it.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import asdict, dataclass, field

from shardserve.bench.workload import Workload
from shardserve.settings.resolve import DTYPE_ALIASES

METHODS = ("auto", "generate_batch", "padded")


@dataclass
class HFRun:
    method: str  # "generate_batch" or "generate (padded)"
    elapsed_s: float  # timed part (see the module doc)
    output_tokens: int
    call_s: float  # the whole call, warm-up included
    settings: dict = field(default_factory=dict)
    fallback_reason: str | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def as_notes(self) -> dict:
        notes = asdict(self)
        notes["output_tokens_per_s"] = self.output_tokens_per_s
        return notes


def hf_dtype(choice: str, config) -> str:
    """The dtype transformers runs in for `bench offline --hf-dtype`: "same" (the engine's resolved dtype),
    "checkpoint" (what transformers' from_pretrained picks by default: the model's config.json, float32 where it
    names none), or a dtype name."""
    if choice == "same":
        return config.dtype
    if choice == "checkpoint":
        with open(os.path.join(config.model, "config.json")) as f:
            hf_config = json.load(f)
        return str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    return DTYPE_ALIASES.get(choice, choice)


def load_hf_model(model_dir: str, dtype: str, device: str, load_format: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if load_format == "dummy":  # random weights: speed does not depend on values
        config = AutoConfig.from_pretrained(model_dir)
        try:
            with torch.device(device):  # initialise on the device: random init of billions of weights on CPU is slow
                model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
        except Exception as exc:
            print(f"warning: building the transformers model on {device} failed ({exc!r}); building it on the CPU")
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation="sdpa",
                                                     local_files_only=True)
    return model.to(device).eval()


def run_hf(model_dir: str, workload: Workload, temperature: float, dtype: str, device: str, load_format: str,
           method: str = "auto") -> HFRun:
    """transformers on the workload's prompts, every output len(workload.output_lens[0]) long (fixed)."""
    if method not in METHODS:
        raise ValueError(f"hf method must be one of {METHODS}, got {method!r}")
    if len(set(workload.output_lens)) != 1:
        raise ValueError("the transformers comparison needs one fixed output length")
    model = load_hf_model(model_dir, dtype, device, load_format)
    try:
        wants_batch = method == "generate_batch" or (method == "auto" and device == "cuda")
        fallback = None if wants_batch else f"method {method} on {device}"
        if wants_batch:
            try:
                return _generate_batch(model, workload, temperature)
            except Exception as exc:  # an API change or a CUDA-only path: say so, and still measure something
                if method == "generate_batch":
                    raise
                fallback = f"generate_batch failed: {type(exc).__name__}: {exc}"
                print(f"warning: {fallback}; falling back to a padded generate")
        run = _generate_padded(model, workload, temperature)
        run.fallback_reason = fallback
        return run
    finally:
        del model
        gc.collect()
        _empty_cuda_cache()


def _sampling(temperature: float) -> dict:
    # top_k/top_p off: ours samples with temperature only, so both do the same work per token
    return dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_k=None, top_p=None)


def _generate_batch(model, workload: Workload, temperature: float) -> HFRun:
    import torch
    from transformers import GenerationConfig

    max_new = workload.output_lens[0]
    # eos_token_id None: generate_batch disables EOS (-1), so every request runs to max_new_tokens.
    config = GenerationConfig(max_new_tokens=max_new, eos_token_id=None, pad_token_id=0, **_sampling(temperature))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    # No inference_mode here: generate_batch fills its cache from a background thread, where tensors made in
    # inference mode may not be updated in place. It runs under no_grad itself.
    outputs = model.generate_batch([list(p) for p in workload.prompts], generation_config=config)
    call_s = time.perf_counter() - start
    results = list(outputs.values())
    errors = [r.error for r in results if getattr(r, "error", None)]
    if len(results) != len(workload.prompts) or errors:
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(workload.prompts)} results; errors: {errors[:3]}")
    produced = sum(len(r.generated_tokens) for r in results)
    created = [r.created_time for r in results]
    finished = [r.lifespan[1] for r in results]
    timed = max(finished) - min(created) if min(finished) > 0 else call_s
    settings = dict(attn_implementation=getattr(model.config, "_attn_implementation", None),
                    generation_config=dict(max_new_tokens=max_new, eos_token_id=None, **_sampling(temperature)),
                    continuous_batching_config="defaults", timed_from="request timestamps" if timed != call_s else "call")
    return HFRun("generate_batch", timed, produced, call_s, settings)


def _generate_padded(model, workload: Workload, temperature: float) -> HFRun:
    """One left-padded batch through generate: every row runs to the fixed length."""
    import torch

    device = model.device
    max_new = workload.output_lens[0]
    longest = max(len(p) for p in workload.prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + list(p) for p in workload.prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in workload.prompts], device=device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                         pad_token_id=0, **_sampling(temperature))
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - longest) * out.shape[0]
    settings = dict(attn_implementation=getattr(model.config, "_attn_implementation", None), batch=len(workload.prompts))
    return HFRun("generate (padded)", elapsed, produced, elapsed, settings)


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
