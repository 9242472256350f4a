"""Engine: the step loop. schedule -> executor.execute(plan) -> update -> stop checks -> deltas.

It owns the scheduler, the block manager and the detokenizers; the executor (in-process, local processes or
gRPC workers) owns every tensor. Per step the work is O(requests in the batch): no pass over all tokens.

Async scheduling (config.async_scheduling; None = on for CUDA): step() submits plan N+1 before it collects
result N, so the controller plans (and the workers prepare) while the device runs; at most two plans are in
flight. The workers append their own sampled tokens (proto/plan.py), so plan N+1 needs nothing from result N.
The costs, handled in the scheduler: a stop is seen one step late (the extra token is discarded, so outputs are
the same as without overlap), a finished request's blocks are freed once its last plan's result is applied, and
a request preempted with a token in flight waits at the queue head until that token lands.

Lost workers: when the executor raises WorkerError the TP group is gone (cluster/executor.py). The owner starts a
new group and calls `restart(executor)`: every live request is recomputed on it from the tokens the controller
has (as a preemption is; cluster/scheduler.py `restart`), so callers see a pause, and greedy or seeded outputs
equal an undisturbed run.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from shardserve.cluster.admission import (Admitted, EncodedPrompt, Prompt, RequestLimits, Seeds, check_request,
                                          check_request_id, check_resumed, encode_prompt, new_request)
from shardserve.cluster.block_manager import BlockManager
from shardserve.cluster.engine_stats import EngineStats, engine_stats
from shardserve.cluster.executor import Executor
from shardserve.cluster.outputs import RequestDelta, RequestOutput, TokenTexts, position_logprobs
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.cluster.scheduler import Scheduler
from shardserve.cluster.structured_outputs import compile_at_admission
from shardserve.cluster.stop_checks import check_stop
from shardserve.cluster.request import Request
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import StepPlan, StepResult, cdiv

MAX_PLANS_IN_FLIGHT = 2  # async scheduling: step N+1 is planned and submitted while step N runs


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (),
        *,
        vocab_size: int,
    ) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.block_manager = self._new_block_manager(executor)
        self.scheduler = Scheduler(config, self.block_manager)
        self.limits = RequestLimits(vocab_size, config.max_model_len, config.block_size, self.block_manager.num_blocks)
        self._arrivals = itertools.count()
        self._seeds = Seeds(config.seed)
        self._finished: dict[str, RequestOutput] = {}  # final outputs not yet taken
        self._pending_deltas: list[RequestDelta] = []  # aborts between steps, reported by the next step()
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_computed_tokens = 0
        self.num_generated_tokens = 0
        self.num_finished = 0
        self.num_restarts = 0  # executors replaced after a failure (restart)
        self.async_scheduling = self._resolve_async_scheduling(config, executor)
        # pipeline stages: as many plans in flight as stages (on disjoint requests: cluster/scheduler.py)
        self.max_plans_in_flight = max(MAX_PLANS_IN_FLIGHT, config.pipeline_parallel_size)
        if not self.async_scheduling:  # one plan at a time: all the requests it can take in one batch
            self.scheduler.num_batches = 1
        self._in_flight: deque[StepPlan] = deque()  # submitted, results not collected yet (async only)
        self._token_text = TokenTexts(tokenizer)  # logprobs' decoded_token
        self._grammar_mask_s = 0.0  # the last applied result's (EngineStats)

    def _new_block_manager(self, executor: Executor) -> BlockManager:  # recording block events where configured
        c = self.config
        return BlockManager(executor.num_kv_blocks, c.block_size, c.enable_prefix_caching, record_events=c.block_events)

    @staticmethod
    def _resolve_async_scheduling(config: EngineConfig, executor: Executor) -> bool:
        wanted = config.async_scheduling
        if wanted is None:  # on CUDA, and wherever pipeline stages would otherwise idle
            wanted = config.device == "cuda" or config.pipeline_parallel_size > 1
        if config.speculative_config:  # each plan proposes from the tokens the previous step kept
            if config.async_scheduling:
                raise ValueError("speculative decoding runs without async scheduling")
            return False
        can = callable(getattr(executor, "submit", None)) and callable(getattr(executor, "collect", None))
        if wanted and not can and config.async_scheduling:
            name = type(executor).__name__
            raise ValueError(f"async_scheduling needs an executor with submit/collect; {name} has none")
        return wanted and can

    # ---- requests ------------------------------------------------------------------------------------------
    def admit(self, req_id: str, prompt: Prompt | EncodedPrompt, params: SamplingParams,
              resumed: Sequence[int] = ()) -> Admitted:
        """The one way in, for every front end: encodes a prompt given as text, token ids or chat messages (a front
        end that routes by token ids or tokenizes off this thread passes an EncodedPrompt), checks the request
        against this engine's limits, draws its seed where it has none, and queues it. Raises ValueError (never
        later in the loop) when the request is malformed or can never fit.

        resumed: the tokens this request generated before (a client resuming a broken stream): they count as
        generated, not as prompt (the sampler's draw depends on the index of the generated token, penalties and
        min_tokens on the generated tokens), and are not streamed again. With the same seed the rest is what the
        unbroken request would have generated."""
        text, token_ids = encode_prompt(prompt, self.tokenizer)
        check_request_id(req_id, self.has_request)
        params = check_request(token_ids, params, self.limits)  # max_tokens None: filled in
        if params.structured_outputs is not None:  # a grammar that cannot compile is refused here (cached by text)
            compile_at_admission(params, self.config.tokenizer, self.vocab_size, self.tokenizer)
        if resumed:
            check_resumed(resumed, params, self.vocab_size)
        params = self._seeds.fill(params)
        spec = params.to_spec(self.eos_token_ids, params.seed)
        seq = new_request(req_id, EncodedPrompt(text, list(token_ids)), params, spec, next(self._arrivals),
                          self.tokenizer, resumed)
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(token_ids)
        return Admitted(len(token_ids), params.max_tokens, params.seed)

    def abort(self, req_id: str) -> bool:
        """Ends a live request with finish_reason "abort"; its final delta comes with the next step().
        Returns False when the id is unknown or already finished."""
        seq = self.scheduler.requests.get(req_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self._pending_deltas.append(self._on_finished(seq))
        return True

    def restart(self, executor: Executor) -> None:
        """Continues over a new executor after the old one failed (its cache and plans in flight are lost; it is
        not shut down here, its owner does that). Live requests keep their tokens and streams and are recomputed."""
        self.executor = executor
        self.block_manager = self._new_block_manager(executor)  # (block events: recorded as before)
        self.scheduler.restart(self.block_manager)
        self.limits = RequestLimits(self.vocab_size, self.config.max_model_len, self.config.block_size,
                                    self.block_manager.num_blocks)
        self._in_flight.clear()
        self.async_scheduling = self._resolve_async_scheduling(self.config, executor)
        self.num_restarts += 1
        self._end_what_cannot_fit()

    def _end_what_cannot_fit(self) -> None:
        """After a restart: a live request that needs more blocks than the new cache has (a group that came back
        with less memory) could never be scheduled again; it ends now, its final delta carrying the reason."""
        num_blocks, block_size = self.block_manager.num_blocks, self.config.block_size
        for seq in list(self.scheduler.requests.values()):
            needed = cdiv(len(seq.prompt_token_ids) + seq.params.max_tokens - 1, block_size)
            if needed > num_blocks:
                self.scheduler.finish(seq, "abort")
                delta = self._on_finished(seq)
                delta.error = (f"the KV cache of the restarted worker group holds {num_blocks} blocks of {block_size} "
                               f"tokens; this request (prompt + max_tokens) needs {needed}")
                self._pending_deltas.append(delta)

    def has_unfinished(self) -> bool:
        """True while there is work: live requests, deltas to report, or submitted plans to collect."""
        return self.scheduler.has_unfinished() or bool(self._pending_deltas) or bool(self._in_flight)

    # ---- the loop ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        deltas, self._pending_deltas = self._pending_deltas, []
        self._grammar_mask_s = 0.0
        if self.async_scheduling:
            self._step_overlapped(deltas)
            return deltas
        plan = self.scheduler.schedule()
        if plan is None:
            self._check_progress()
            return deltas
        result = self.executor.execute(plan)
        self._count(plan)
        self._apply(plan, result, deltas)
        return deltas

    def _step_overlapped(self, deltas: list[RequestDelta]) -> None:
        """Submits the next plan (while fewer than max_plans_in_flight are), then collects the oldest one, unless the
        plan just submitted is the only one: the first step of a burst only submits."""
        plan = self.scheduler.schedule() if len(self._in_flight) < self.max_plans_in_flight else None
        if plan is not None:
            self.executor.submit(plan)
            self._in_flight.append(plan)
            self._count(plan)
        if not self._in_flight:
            self._check_progress()
            return
        if plan is None or len(self._in_flight) == self.max_plans_in_flight:
            done = self._in_flight.popleft()
            self._apply(done, self.executor.collect(), deltas)

    def _check_progress(self) -> None:
        """Called when nothing was scheduled and nothing is in flight: then waiting requests must be admissible."""
        if self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("scheduler bug: requests are waiting but none could be scheduled")

    def _count(self, plan: StepPlan) -> None:
        self.num_steps += 1
        self.num_computed_tokens += plan.num_batched_tokens
        for new in plan.new_requests:
            seq = self.scheduler.requests.get(new.req_id)
            if seq is not None and seq.first_scheduled_at is None:
                seq.first_scheduled_at = time.perf_counter()

    def _apply(self, plan: StepPlan, result: StepResult, deltas: list[RequestDelta]) -> None:
        """Applies a result: appends the tokens, runs the stop checks, adds a delta per request that got a token
        (a final_only request: only when it ends, its one delta carrying every token)."""
        if result.prompt_logprobs:
            self._apply_prompt_logprobs(result)
        self._grammar_mask_s = result.grammar_mask_ms / 1e3
        for seq in self.scheduler.update(plan, result):
            # Usually one new token; a request that verified drafts may have several: each is checked in turn, and
            # a stop among them drops the tokens after it.
            total = len(seq.output_token_ids)
            reason = None
            for n in range(total - seq.num_new_tokens + 1, total + 1):
                self.num_generated_tokens += 1
                if seq.logprobs is not None and seq.logprobs[n - 1] is not None:
                    lp = seq.logprobs[n - 1]
                    seq.cumulative_logprob += lp.logprob
                    seq.logprobs[n - 1] = position_logprobs(seq.output_token_ids[n - 1], lp, self._token_text)
                reason = check_stop(seq, n, self.config.max_model_len)
                if reason is not None:
                    if n < total:
                        seq.truncate_output(n)
                    break
            if reason is not None:
                self.scheduler.finish(seq, reason)
                deltas.append(self._on_finished(seq))
            elif not seq.params.final_only:  # a final-only request's tokens wait for its last delta
                deltas.append(seq.delta(final=False))

    def _apply_prompt_logprobs(self, result: StepResult) -> None:
        for entry in result.prompt_logprobs:
            if (seq := self.scheduler.requests.get(entry.req_id)) is not None:
                seq.fill_prompt_logprobs(entry.start, entry.logprobs, self._token_text)

    # ---- outputs -------------------------------------------------------------------------------------------
    def _on_finished(self, seq: Request) -> RequestDelta:
        if seq.detokenizer is not None and seq.finish_reason != "stop":
            seq.detokenizer.flush()
        self.num_finished += 1
        self._finished[seq.req_id] = seq.output()
        return seq.delta(final=True)

    def get_output(self, req_id: str) -> RequestOutput | None:
        """The final output of a finished request (kept until taken), or a snapshot of a live one."""
        if req_id in self._finished:
            return self._finished[req_id]
        seq = self.scheduler.requests.get(req_id)
        return seq.output() if seq is not None else None

    def pop_output(self, req_id: str) -> RequestOutput | None:
        """Removes and returns a finished request's output (its id becomes reusable); None if not finished."""
        return self._finished.pop(req_id, None)

    def has_request(self, req_id: str) -> bool:
        """True while the id is live or its final output has not been popped."""
        return req_id in self.scheduler.requests or req_id in self._finished

    def take_finished(self) -> list[RequestOutput]:
        """Removes and returns every finished output, in finishing order."""
        outputs = list(self._finished.values())
        self._finished.clear()
        return outputs

    # ---- the KV cache, as the engine's owners see it ------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the KV cache (of the current executor)."""
        return self.block_manager.num_blocks

    def take_block_events(self) -> list[tuple[int, bool]]:
        """The prefix cache's (chain hash, stored) events since the last call, for a router's index (cluster/
        router.py); [] unless config.block_events. Evicted and forgotten hashes come as (hash, False)."""
        return self.block_manager.take_events()

    def reset_prefix_cache(self, kv_blocks: int | None = None) -> int:
        """For A/B benchmarks, while no request is live: forgets the prefix cache (its events are dropped: the
        caller forgets this engine's entries in its router) and keeps kv_blocks usable blocks (None: all).
        Returns the blocks now usable."""
        bm = self.block_manager
        bm.reset_prefix_cache()
        usable = bm.limit_blocks(bm.num_blocks if kv_blocks is None else kv_blocks)
        bm.take_events()
        return usable

    def stats(self) -> EngineStats:
        return engine_stats(self)

    def shutdown(self) -> None:
        self.executor.shutdown()
