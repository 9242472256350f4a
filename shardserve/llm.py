"""LLM: offline generation in one process (TP=1) or with local worker processes (TP > 1).

Its settings resolve into an EngineConfig (shardserve/config.py), and shardserve/engine_factory.py wires the
controller-side Engine (cluster/) to an Executor (worker/): the two talk only through StepPlan and StepResult
(proto/plan.py), so the same Engine drives the in-process worker and gRPC workers (local processes or Ray actors). Requests are admitted as
the server admits them (Engine.admit: cluster/admission.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

from shardserve.cluster.admission import Prompt, encode_prompt
from shardserve.cluster.outputs import RequestDelta, RequestOutput
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.config import build_engine_config
from shardserve.engine_factory import build_engine
from shardserve.proto.config import EngineConfig


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
        return GrpcExecutor(config, workers.endpoints, workers.init_method, stop_workers=workers.stop,
                            secret=workers.secret)
    except BaseException:
        workers.stop(timeout_s=0.0)
        raise


def _check_local_devices(config: EngineConfig) -> None:
    """LLM runs every rank on this host: CUDA ranks need that many GPUs here (one line, before loading anything)."""
    if config.device != "cuda":
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < config.tensor_parallel_size:
        raise ValueError(
            f"--device cuda (device='cuda') with --tp {config.tensor_parallel_size} needs "
            f"{config.tensor_parallel_size} CUDA GPU(s) on this host; it has {have}"
        )


class LLM:
    def __init__(self, model: str | None = None, **settings) -> None:
        """model and settings: EngineConfig's user settings (proto/config.py; the same as the CLI's engine flags,
        `shardserve generate --help` lists them), e.g. tensor_parallel_size=2, max_model_len=2048. An unknown
        name is a TypeError."""
        self.config = build_engine_config(model=model, **settings)
        _check_local_devices(self.config)
        self.engine = build_engine(self.config, create_executor)
        self.executor = self.engine.executor
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        req_id = str(next(self._ids))
        self.engine.admit(req_id, prompt, params or SamplingParams())
        return req_id

    def get_tokenizer(self):
        """The model's tokenizer (transformers), or None for a model without one (dummy weights)."""
        return self.tokenizer

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return encode_prompt(list(messages), self.tokenizer)[1]

    # ---- generation -----------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt, batched continuously; outputs come back in prompt order. A prompt is text,
        token ids, chat messages, or a vLLM prompt dict ({"prompt": text} or {"prompt_token_ids": [...]}); one
        prompt or a list of them. A bad prompt raises ValueError before any of them runs."""
        if isinstance(prompts, (str, dict)) or (
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
        req_ids = []
        try:
            for prompt, p in zip(prompts, params):
                req_ids.append(self.add_request(prompt, p))
        except Exception:
            for req_id in req_ids:
                self.engine.abort(req_id)
            self._drain()
            for req_id in req_ids:
                self.engine.pop_output(req_id)
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
