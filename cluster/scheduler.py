"""Scheduler: decides, each step, which requests compute how many tokens; emits the StepPlan deltas.

Policy (continuous batching, FCFS):
1. Running requests first, oldest arrival first: a decode computes 1 token, an unfinished (chunked) prefill the
   rest of its tokens up to the remaining token budget. When a running request needs a block and none is free,
   the latest-arrived running request not yet scheduled this step is preempted by recompute (possibly the
   request itself): its blocks are freed, it goes back to the front of the waiting queue and its KV is later
   recomputed from prompt + generated tokens.
2. Then waiting requests, in order, while max_num_seqs, the token budget and free blocks allow; a prompt longer
   than the remaining budget gets a chunk of it, so prefills share a step with decodes. Nothing is admitted in a
   step that preempted. A waiting request whose next uncached block is one a running request is computing now
   (the same prompt prefix, arrived together: n outputs of a prompt, a burst sharing a system prompt) waits at
   the front of the queue, while the requests behind it go ahead, until that block is in the prefix cache; it
   then computes only what the cache does not hold instead of the same prefix a second time.

Planning ahead: `num_computed_tokens` advances when a plan is made, and a plan that reaches the end of a
request's token list counts one pending sampled token. So step N+1 can be planned before step N's result is
applied; `update` then appends tokens one step late, discards tokens of requests finished meanwhile, and
registers blocks in the prefix cache only once the plan that computed them has run. What that costs:
- A finished request's blocks are freed only once the last plan that computed it has been applied
  (`_free_after`): a block is never handed out again while a submitted plan may still write it.
- A preempted request's blocks are freed at once (the preemption needs them). A plan in flight may still write
  them; that is safe because every executor runs plans in submission order (one stream per rank), so the later
  plan's writes land last, and a block enters the prefix cache only after the plan that filled it was applied.
  The request's token from that plan still lands (it waits at the queue head until then, see `schedule`).

Pipeline stages (pipeline_parallel_size N > 1): up to N plans are in flight, each on its own requests: a request
in a plan whose result has not been applied is left out of the next plans (never in two batches at once), and a
plan takes at most 1/N of the live requests (and of max_num_seqs), so that they make N batches that follow each other
through the stages (one batch at a time when the engine overlaps no plans). The stages before the last do not sample: each plan carries, per scheduled request, the token
its previous step sampled (`StepPlan.sampled_token_ids`), which the controller has by then.

Lost workers (`restart`): when the TP group fails, its KV cache and every plan in flight are gone. Every live
request goes back to waiting as a preempted one does, with only the tokens whose values the controller has
(prompt + generated so far; a token sampled by a plan whose result never came is dropped, and sampled again by the
new group: the sampler's draw depends only on (seed, token index), so it is the same token). The new group has
a new, empty cache and its step ids start at 1 again.
"""

from __future__ import annotations

import bisect
from collections import deque

from shardserve.cluster.block_manager import BlockManager
from shardserve.cluster.request import RequestStatus, Request
from shardserve.cluster.speculation import Speculator
from shardserve.proto.config import EngineConfig
from shardserve.proto.speculative import parse_speculative_config
from shardserve.proto.plan import NewRequest, StepPlan, StepResult


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival
        self.requests: dict[str, Request] = {}  # every live (not finished) request
        self.step_id = 0
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0  # prefix-cache hits at first admission
        self.num_prefix_waits = 0  # steps a waiting request waited for a running one to compute its prefix
        self._finished_ids: list[str] = []  # to tell the workers in the next plan
        self._preempted_ids: list[str] = []
        # step id -> (seq, its epoch when planned, num_computed_tokens after that step): what update() confirms
        self._in_flight: dict[int, list[tuple[Request, int, int]]] = {}
        self._free_after: dict[int, list[Request]] = {}  # step id -> finished requests whose blocks it may write
        self.last_applied_step_id = 0  # the newest plan whose result update() has applied
        spec = parse_speculative_config(config.speculative_config)
        self.speculator: Speculator | None = Speculator(spec) if spec is not None else None
        self.pipeline = config.pipeline_parallel_size > 1  # plans in flight on disjoint requests (see above)
        # batches the live requests are split into: one per stage while plans overlap (the engine sets 1 when it
        # runs one plan at a time)
        self.num_batches = config.pipeline_parallel_size

    # ---- admission -----------------------------------------------------------------------------------------
    def add(self, seq: Request) -> None:
        """Queues a request that passed admission (cluster/admission.py: it fits max_model_len and the cache)."""
        if seq.req_id in self.requests:
            raise ValueError(f"request id {seq.req_id!r} is already in use")
        seq.status = RequestStatus.WAITING
        self.requests[seq.req_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Request, reason: str) -> None:
        """Ends a live request (stop, length or abort): frees its blocks and tells the workers next plan."""
        if seq.is_finished:
            return
        if seq.status is RequestStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.last_step_id > self.last_applied_step_id:  # a submitted plan may still write its blocks
            self._free_after.setdefault(seq.last_step_id, []).append(seq)
        else:
            self.block_manager.free(seq)
        if seq.known_to_workers:
            self._finished_ids.append(seq.req_id)
            seq.known_to_workers = False
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.req_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_plans_in_flight(self) -> int:
        """Plans made whose results update() has not applied yet."""
        return len(self._in_flight)

    def restart(self, block_manager: BlockManager) -> None:
        """The workers were replaced (their cache and the plans in flight are lost): every live request waits
        again, in arrival order, to be sent in full to the new workers, whose cache `block_manager` describes."""
        self.block_manager = block_manager
        for seq in self.requests.values():
            seq.block_ids = []  # the old cache is gone: nothing to free
            seq.num_registered_blocks = 0
            seq.num_computed_tokens = 0
            seq.num_pending_tokens = 0  # sampled by a plan whose result never came: dropped, sampled again
            seq.known_to_workers = False
            seq.last_step_id = 0
            seq.epoch += 1
            if seq.status is RequestStatus.RUNNING:
                seq.status = RequestStatus.PREEMPTED
        self.waiting = deque(sorted(self.requests.values(), key=lambda s: s.arrival))
        self.running = []
        self.step_id = 0
        self.last_applied_step_id = 0
        self._in_flight.clear()
        self._free_after.clear()  # finished requests' blocks: in the old cache
        self._finished_ids, self._preempted_ids = [], []

    # ---- planning ------------------------------------------------------------------------------------------
    def _preempt(self, seq: Request) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.epoch += 1
        seq.status = RequestStatus.PREEMPTED
        if seq.known_to_workers:
            self._preempted_ids.append(seq.req_id)
            seq.known_to_workers = False
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @staticmethod
    def _wants_tokens(seq: Request, max_model_len: int) -> int:
        """Tokens seq could compute now: the rest of its list, or 0 when it is done once pending tokens land."""
        # seq.num_tokens and seq.num_output_tokens spelled out: this runs for every running request each step.
        pending = seq.num_pending_tokens
        num_tokens = len(seq.token_ids) + pending
        if len(seq.output_token_ids) + pending >= seq.params.max_tokens or num_tokens >= max_model_len:
            return 0
        return num_tokens - seq.num_computed_tokens

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing can run (then nothing is consumed)."""
        budget = self.config.max_num_batched_tokens
        req_ids: list[str] = []
        num_tokens: list[int] = []
        new_block_ids: dict[str, list[int]] = {}
        new_requests: list[NewRequest] = []
        scheduled: list[Request] = []
        preempted = False

        max_model_len = self.config.max_model_len
        speculator = self.speculator if self.speculator is not None and self.speculator.active(len(self.running)) \
            else None
        draft_token_ids: dict[str, list[int]] = {}
        per_plan, pipeline, applied = self.config.max_num_seqs, self.pipeline, self.last_applied_step_id
        if self.num_batches > 1:  # an even share of the live requests, so that every stage has a batch
            per_plan = -(-min(per_plan, len(self.requests)) // self.num_batches)
        i = 0
        while i < len(self.running) and budget > 0 and len(req_ids) < per_plan:
            seq = self.running[i]
            if pipeline and seq.last_step_id > applied:  # in a plan in flight: not in a second one
                i += 1
                continue
            n = min(self._wants_tokens(seq, max_model_len), budget)
            if n <= 0:
                i += 1
                continue
            drafts = None
            if (speculator is not None and n == 1 and not seq.num_pending_tokens
                    and seq.params.structured_outputs is None):  # (a grammar would have to follow the drafts)
                # room for the drafts and the token after them within max_tokens, max_model_len and the budget
                limit = min(seq.params.max_tokens - len(seq.output_token_ids), max_model_len - len(seq.token_ids),
                            budget) - 1
                drafts = speculator.propose(seq, limit)
                n += len(drafts)
            new = self.block_manager.append_slots(seq, seq.num_computed_tokens + n)
            if new is None and drafts:  # no room for the drafts: decode one token rather than preempt for them
                n, drafts = 1, None
                new = self.block_manager.append_slots(seq, seq.num_computed_tokens + n)
            while new is None:  # out of blocks: preempt the latest arrival not yet scheduled
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                new = self.block_manager.append_slots(seq, seq.num_computed_tokens + n)
            if new is None:
                break  # seq preempted itself; everything after it is gone too
            if new:
                new_block_ids[seq.req_id] = new
            if drafts:
                draft_token_ids[seq.req_id] = drafts
            req_ids.append(seq.req_id)
            num_tokens.append(n)
            scheduled.append(seq)
            budget -= n
            i += 1

        computing: set[int] | None = None  # hashes of the full blocks running requests are computing (built once)
        waits: list[Request] = []  # waiting requests whose next block is among them: they keep their place
        while (self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(req_ids) < per_plan):
            seq = self.waiting[0]
            if seq.num_pending_tokens:  # a token from a plan made before its preemption is still to land
                break
            # Prompt logprobs need every prompt position computed: no prefix-cache hits for such requests.
            uses_cache = seq.spec.prompt_logprobs < 0 and self.block_manager.enable_prefix_caching
            hits = self.block_manager.find_cached_prefix(seq) if uses_cache else []
            if uses_cache and len(hits) < len(seq.block_hashes):
                if computing is None:
                    computing = {h for s in self.running for h in s.block_hashes[s.num_registered_blocks:]}
                if seq.block_hashes[len(hits)] in computing:
                    waits.append(self.waiting.popleft())
                    continue
            num_cached = len(hits) * self.block_manager.block_size
            n = min(len(seq.token_ids) - num_cached, budget)
            if not self.block_manager.allocate(seq, hits, num_cached + n):
                break
            self.waiting.popleft()
            if seq.status is RequestStatus.WAITING:
                seq.num_cached_tokens = num_cached
                self.num_cached_prompt_tokens += num_cached
            seq.status = RequestStatus.RUNNING
            seq.num_computed_tokens = num_cached
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            new_requests.append(
                NewRequest(
                    req_id=seq.req_id,
                    token_ids=list(seq.token_ids),
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_computed_tokens=num_cached,
                    block_ids=list(seq.block_ids),
                    sampling=seq.spec,
                )
            )
            seq.known_to_workers = True
            seq.num_tokens_sent = len(seq.token_ids)
            req_ids.append(seq.req_id)
            num_tokens.append(n)
            scheduled.append(seq)
            budget -= n
            if computing is not None:  # its blocks are now being computed too
                computing.update(seq.block_hashes[len(hits):])
        self.waiting.extendleft(reversed(waits))
        self.num_prefix_waits += len(waits)

        if not req_ids:
            return None
        self.step_id += 1
        in_flight = []
        for seq, n in zip(scheduled, num_tokens):
            drafts = draft_token_ids.get(seq.req_id) if draft_token_ids else None
            if drafts:
                # verified this step: after the result, computed = the tokens kept less the new last one (update)
                seq.num_computed_tokens += n - len(drafts)
                seq.num_pending_tokens += 1
                in_flight.append((seq, seq.epoch, -len(drafts)))
                seq.last_step_id = self.step_id
                continue
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq.token_ids) + seq.num_pending_tokens:  # the end: one token sampled
                seq.num_pending_tokens += 1
            in_flight.append((seq, seq.epoch, seq.num_computed_tokens))
            seq.last_step_id = self.step_id
        self._in_flight[self.step_id] = in_flight
        sampled: list[int] = []
        if pipeline:  # the stages that do not sample get each request's token from its previous step
            for seq in scheduled:
                sent = seq.num_tokens_sent
                sampled.append(seq.token_ids[sent] if sent < len(seq.token_ids) else -1)
                seq.num_tokens_sent = len(seq.token_ids)
        plan = StepPlan(
            step_id=self.step_id,
            new_requests=new_requests,
            req_ids=req_ids,
            num_tokens=num_tokens,
            new_block_ids=new_block_ids,
            finished_req_ids=self._finished_ids,
            preempted_req_ids=self._preempted_ids,
            draft_token_ids=draft_token_ids,
            sampled_token_ids=sampled,
        )
        self._finished_ids, self._preempted_ids = [], []
        return plan

    # ---- results -------------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Applies a plan's result: appends sampled tokens and registers blocks now full of computed KV.

        Returns the live requests that got a token (in result order), for the engine's stop checks.
        """
        if result.step_id != plan.step_id:
            raise RuntimeError(f"result for step {result.step_id} does not match plan {plan.step_id}")
        records = self._in_flight.pop(plan.step_id)
        self.last_applied_step_id = plan.step_id
        verified = []  # (seq, number of drafts) of the requests that verified drafts (computed < 0 marks them)
        for seq, epoch, computed in records:
            if epoch == seq.epoch and not seq.is_finished:
                if computed < 0:
                    verified.append((seq, -computed))
                else:
                    self.block_manager.register_full_blocks(seq, computed)
        for seq in self._free_after.pop(plan.step_id, ()):
            self.block_manager.free(seq)
        # By object, not by id: a finished request's id may already belong to a new request.
        planned = {seq.req_id: seq for seq, _, _ in records}
        got_token: list[Request] = []
        logprobs = result.logprobs or [None] * len(result.req_ids)
        last = None
        for req_id, token, lp in zip(result.req_ids, result.token_ids, logprobs):
            seq = planned.get(req_id)
            if seq is None or seq.is_finished:  # finished or aborted after this plan was made: discarded
                continue
            if seq is not last:  # its first token of this result (a verifying request has several entries)
                seq.num_pending_tokens -= 1
                seq.num_new_tokens = 0
                got_token.append(seq)
                last = seq
            seq.num_new_tokens += 1
            seq.append_token(token, lp)
        for seq, num_drafts in verified:
            self._settle_verified(seq, num_drafts)
        return got_token

    def _settle_verified(self, seq: Request, num_drafts: int) -> None:
        """After a verification step: the drafts kept are computed, the rejected ones' positions are free again
        (the table cut to the blocks the tokens occupy, as the workers cut theirs), and only kept tokens' full
        blocks enter the prefix cache."""
        kept = seq.num_new_tokens - 1
        if self.speculator is not None:
            self.speculator.stats.observe(num_drafts, kept)
        seq.num_computed_tokens = len(seq.token_ids) - 1
        self.block_manager.trim(seq, len(seq.token_ids))
        self.block_manager.register_full_blocks(seq, seq.num_computed_tokens)
