"""LLM: offline generation in one process (TP=1) or with local worker processes (TP > 1), on one TP group or
(data_parallel_size=M) on M of them.

Its settings resolve into an EngineConfig (shardserve/settings/resolve.py), and shardserve/settings/engine_factory.py
wires the controller-side Engine (cluster/) to an Executor (worker/): the two talk only through StepPlan and
StepResult (proto/plan.py), so the same Engine drives the in-process worker and gRPC workers (local processes or Ray
actors). Requests are admitted as the server admits them (Engine.admit: cluster/admission.py).

Data parallelism (data_parallel_size=M): M engines, each over its own group of local worker processes (on CUDA,
group i's ranks see GPUs i*tp .. i*tp+tp-1), each with its own KV cache. Every request goes to one of them through
the server's global scheduler (cluster/router.py, cache-aware: prompts sharing leading blocks follow each other,
the rest by the fewest outstanding tokens): as the server does, the prompt is encoded and its seed drawn before it
is routed, then the chosen engine admits it (Engine.admit). generate() steps the M engines on M threads (a step
waits on its workers with the GIL released), so the groups compute at once. Greedy outputs equal one engine's.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import warnings
from collections.abc import Iterator, Sequence

from shardserve.cluster.admission import Prompt, Seeds, encode_prompt
from shardserve.cluster.engine import Engine
from shardserve.cluster.replica import ReplicaLoad
from shardserve.cluster.router import Router
from shardserve.cluster.outputs import RequestDelta, RequestOutput
from shardserve.cluster.sampling_params import SamplingParams, output_seed
from shardserve.api.local_executors import check_local_devices, create_executor
from shardserve.settings.resolve import build_engine_config
from shardserve.settings.engine_factory import build_engine


class _Member:
    """One engine of an LLM with data parallelism, as the router sees a replica."""

    serving, recovering = True, False

    def __init__(self, index: int, engine: Engine) -> None:
        self.id = f"dp{index}"
        self.engine = engine
        self.load = ReplicaLoad()
        self.load.num_kv_blocks = self.load.num_free_blocks = engine.num_kv_blocks


class LLM:
    def __init__(self, model: str | None = None, data_parallel_size: int = 1, trust_remote_code: bool = False,
                 **settings) -> None:
        """model and settings: EngineConfig's user settings (proto/config.py; the same as the CLI's engine flags,
        `shardserve generate --help` lists them), e.g. tensor_parallel_size=2, max_model_len=2048. An unknown
        name is a TypeError. data_parallel_size: TP groups (engines, each with its own KV cache) to spread the
        requests over. model: also a hub id ("org/name") already in the local Hugging Face cache (never
        downloaded). trust_remote_code: vLLM's, accepted with a warning (no model's own code runs here)."""
        if trust_remote_code:
            from shardserve.settings.resolve import TRUST_REMOTE_CODE_NOTE

            warnings.warn(TRUST_REMOTE_CODE_NOTE, stacklevel=2)
        if not isinstance(data_parallel_size, int) or isinstance(data_parallel_size, bool) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        self.config = build_engine_config(model=model, offline=True, **settings)
        if data_parallel_size > 1:  # the router's index follows each engine's cache (stored, evicted blocks)
            self.config = dataclasses.replace(self.config, block_events=True)
        check_local_devices(self.config, data_parallel_size)
        self.engines = []
        try:
            for group in range(data_parallel_size):
                self.engines.append(build_engine(self.config, lambda c, g=group: create_executor(
                    c, g, data_parallel_size)))
        except BaseException:
            self.shutdown()
            raise
        self.engine = self.engines[0]  # the one engine at data_parallel_size 1
        self.executor = self.engine.executor
        self.tokenizer = self.engine.tokenizer
        self._router = Router([_Member(i, e) for i, e in enumerate(self.engines)]) if len(self.engines) > 1 else None
        self._seeds = Seeds(self.config.seed)  # with several engines: drawn before routing, as the server does
        self._router_lock = threading.Lock()  # the engines' threads feed the router's index
        self._engine_of: dict[str, tuple[int, int]] = {}  # request id -> (its engine's position, its cost)
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        req_id = str(next(self._ids))
        params = params or SamplingParams()
        if self._router is None:
            self.engine.admit(req_id, prompt, params)
            return req_id
        encoded, params = encode_prompt(prompt, self.tokenizer), self._seeds.fill(params)
        with self._router_lock:
            position, _ = self._router.route_prompt(encoded.token_ids, self.config.block_size)
        admitted = self.engines[position].admit(req_id, encoded, params)
        self._router.replicas[position].load.admitted(admitted.cost)
        self._engine_of[req_id] = (position, admitted.cost)
        return req_id

    def _engine(self, req_id: str) -> Engine:
        placed = self._engine_of.get(req_id)
        return self.engine if placed is None else self.engines[placed[0]]

    def _pop_output(self, req_id: str) -> RequestOutput:
        output = self._engine(req_id).pop_output(req_id)
        placed = self._engine_of.pop(req_id, None)
        if placed is not None:
            self._router.replicas[placed[0]].load.finished(placed[1])
        return output

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
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise TypeError(f"prompts must be text, token ids, a prompt dict or a list of them; got "
                            f"{type(prompts).__name__} {prompts!r:.80}")
        _check_sampling_params(sampling_params)
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
        # Nothing here reads the deltas: each request's tokens come back in one at its end (final_only), which
        # spares the engine a delta per request per step (bench host: 0.45 -> 0.32 ms of host work a step at 256).
        # n outputs of a prompt are n requests (admitted together: the first computes the prompt, the others wait
        # for its blocks in the prefix cache, cluster/scheduler.py), output i of a seeded one drawing with
        # seed + i: what a request of its own with that seed gives.
        work = []  # (prompt index, prompt, params of one output)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            p = p or SamplingParams()
            for j in range(p.n):
                work.append((i, prompt, dataclasses.replace(p, final_only=True, n=1, seed=output_seed(p.seed, j))))
        req_ids = []
        try:
            for _, prompt, p in work:
                req_ids.append(self.add_request(prompt, p))
        except Exception:
            for req_id in req_ids:
                self._engine(req_id).abort(req_id)
            self._drain()
            for req_id in req_ids:
                self._pop_output(req_id)
            raise
        self._run(req_ids, use_tqdm)
        results: list[RequestOutput] = []
        for (i, _, _), req_id in zip(work, req_ids):
            output = self._pop_output(req_id)
            if len(results) == i:
                results.append(output)
            else:  # another output of prompt i
                completion = output.outputs[0]
                completion.index = len(results[i].outputs)
                results[i].outputs.append(completion)
        return results

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
        _check_sampling_params(sampling_params, one=True)
        req_id = self.add_request(prompt, sampling_params)
        engine = self._engine(req_id)
        try:
            while True:
                for delta in self._step(engine):
                    if delta.request_id == req_id:
                        yield delta
                        if delta.finished:
                            self._pop_output(req_id)
                            return
        finally:
            if engine.has_request(req_id):
                engine.abort(req_id)
                self._drain()
                self._pop_output(req_id)

    def _run(self, req_ids: list[str], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(req_ids), desc="requests", unit="req", dynamic_ncols=True)
        start = time.perf_counter()
        counted = sum(e.num_generated_tokens for e in self.engines)  # the engines' counts before this call
        lock = threading.Lock()

        def steps(engine: Engine) -> None:
            while engine.has_unfinished():
                deltas = self._step(engine)
                with lock:
                    if bar is not None:
                        generated = sum(e.num_generated_tokens for e in self.engines) - counted
                        bar.update(sum(d.finished for d in deltas))
                        bar.set_postfix_str(f"{generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s",
                                            refresh=False)

        try:
            self._on_every_engine(steps)
        finally:
            if bar is not None:
                bar.close()

    def _on_every_engine(self, fn) -> None:
        """fn(engine) for every engine with work, each on a thread of its own when there are several (their steps
        wait on their workers with the GIL released); the first error raises once all have ended."""
        busy = [e for e in self.engines if e.has_unfinished()]
        if len(busy) <= 1:
            for engine in busy:
                fn(engine)
            return
        errors: list[BaseException] = []

        def run(engine: Engine) -> None:
            try:
                fn(engine)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(e,), name="shardserve-llm-engine", daemon=True) for e in busy]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _step(self, engine: Engine) -> list[RequestDelta]:
        deltas = engine.step()
        if self._router is not None:  # its cache's stored and evicted blocks, for the router's index
            with self._router_lock:
                self._router.apply_events(self.engines.index(engine), engine.take_block_events())
        return deltas

    def _drain(self) -> None:
        """Runs steps until aborted requests are gone from the workers too."""
        def drain(engine: Engine) -> None:
            while engine.has_unfinished():
                self._step(engine)

        self._on_every_engine(drain)

    # ---- lifetime -------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        engines, self.engines = getattr(self, "engines", []), []
        self.executor = None
        for engine in engines:
            engine.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _check_sampling_params(sampling_params, one: bool = False) -> None:
    """A TypeError that says what is expected, for what is not a SamplingParams (a dict of its keywords, most often)."""
    many = () if one else (list, tuple)
    items = sampling_params if isinstance(sampling_params, many) and many else [sampling_params]
    for p in items:
        if p is not None and not isinstance(p, SamplingParams):
            hint = ": write SamplingParams(**{...}) for a dict of its keywords" if isinstance(p, dict) else ""
            raise TypeError(f"sampling_params must be a SamplingParams{'' if one else ' or a list of them, one a prompt'}"
                            f"; got {type(p).__name__}{hint}")
