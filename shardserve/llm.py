"""LLM: offline generation in one process (TP=1) or with local worker processes (TP > 1).

It wires the controller-side Engine (cluster/) to an Executor: the two talk only through StepPlan and StepResult
(proto/plan.py), so the same Engine drives the in-process worker and gRPC workers (local processes or Ray actors).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

from shardserve.cluster.engine import Engine
from shardserve.cluster.outputs import RequestDelta, RequestOutput
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.config import build_engine_config, load_tokenizer, model_facts
from shardserve.proto.config import EngineConfig

Prompt = str | list[int]


def create_executor(config: EngineConfig):
    """TP=1 runs the model in this process. TP > 1 runs one local process per rank, each serving the Worker gRPC
    service on loopback (joined by torch.distributed), driven by a GrpcExecutor that stops them with itself."""
    if config.tensor_parallel_size == 1:
        from shardserve.worker.inprocess import InProcessExecutor

        return InProcessExecutor(config)
    from shardserve.cluster.executor import GrpcExecutor
    from shardserve.worker.local_workers import start_local_workers

    workers = start_local_workers(config)
    try:
        return GrpcExecutor(config, workers.endpoints, workers.init_method, stop_workers=workers.stop)
    except BaseException:
        workers.stop(timeout_s=0.0)
        raise


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        load_format: str = "auto",
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        gpu_memory_utilization: float = 0.9,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        seed: int = 0,
    ) -> None:
        self.config = build_engine_config(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            device=device,
            dtype=dtype,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            load_format=load_format,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb,
            gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            seed=seed,
        )
        self.tokenizer = load_tokenizer(self.config)
        facts = model_facts(self.config, self.tokenizer)
        self.executor = create_executor(self.config)
        self.engine = Engine(
            self.config,
            self.executor,
            tokenizer=self.tokenizer,
            eos_token_ids=facts.eos_token_ids,
            vocab_size=facts.vocab_size,
        )
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy weights): give prompts as token-id lists")
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        text, token_ids = self._encode(prompt)
        req_id = str(next(self._ids))
        self.engine.add_request(req_id, token_ids, params or SamplingParams(), prompt=text)
        return req_id

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- generation -----------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt, batched continuously; outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]  # validate every prompt before admitting any
        req_ids = []
        try:
            for (text, token_ids), p in zip(encoded, params):
                req_id = str(next(self._ids))
                self.engine.add_request(req_id, token_ids, p, prompt=text)
                req_ids.append(req_id)
        except Exception:
            for req_id in req_ids:
                self.engine.abort(req_id)
            self._drain()
            raise
        self._run(req_ids, use_tqdm)
        return [self.engine.pop_output(r) for r in req_ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestDelta]:
        """Yields one request's deltas (text and token ids) as they are generated."""
        req_id = self.add_request(prompt, sampling_params)
        try:
            while True:
                for delta in self.engine.step():
                    if delta.request_id == req_id:
                        yield delta
                        if delta.finished:
                            self.engine.pop_output(req_id)
                            return
        finally:
            if self.engine.has_request(req_id):
                self.engine.abort(req_id)
                self._drain()
                self.engine.pop_output(req_id)

    def _run(self, req_ids: list[str], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(req_ids), desc="requests", unit="req", dynamic_ncols=True)
        start, generated, done = time.perf_counter(), 0, 0
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                generated += len(delta.token_ids)
                if delta.finished:
                    done += 1
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.set_postfix_str(f"{generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s", refresh=False)
        if bar is not None:
            bar.close()

    def _drain(self) -> None:
        """Runs steps until aborted requests are gone from the workers too."""
        while self.engine.has_unfinished():
            self.engine.step()

    # ---- lifetime -------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        executor, self.executor = getattr(self, "executor", None), None
        if executor is not None:
            executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
