"""EngineStats: what an engine reports of itself (its queues, KV cache and counters), read between two steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_kv_blocks: int
    num_kv_blocks_used: int
    num_kv_blocks_cached: int  # findable by prefix lookup (in use or free)
    kv_usage: float
    num_steps: int
    num_preemptions: int
    num_prompt_tokens: int  # prompt tokens of admitted requests
    num_cached_prompt_tokens: int  # prefix-cache hits at first admission
    num_computed_tokens: int  # positions computed by the workers (prefill, recompute and decode)
    num_generated_tokens: int
    num_finished: int
    # speculative decoding (vLLM's spec_decode counters; 0 without it): verification rows, draft tokens proposed,
    # draft tokens accepted, and per draft position the drafts accepted up to and including it
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    grammar_mask_s: float = 0.0  # the last applied step's structured-output mask time on the workers (0: none)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verification step gains on average (1 + accepted drafts); 0 before any."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


def engine_stats(engine) -> EngineStats:
    """What an Engine (cluster/engine.py) reports: its queues, KV cache and counters."""
    bm = engine.block_manager
    stats = EngineStats(
        num_waiting=len(engine.scheduler.waiting),
        num_running=len(engine.scheduler.running),
        num_kv_blocks=bm.num_blocks,
        num_kv_blocks_used=bm.num_used_blocks,
        num_kv_blocks_cached=bm.num_cached_blocks,
        kv_usage=bm.usage,
        num_steps=engine.num_steps,
        num_preemptions=engine.scheduler.num_preemptions,
        num_prompt_tokens=engine.num_prompt_tokens,
        num_cached_prompt_tokens=engine.scheduler.num_cached_prompt_tokens,
        num_computed_tokens=engine.num_computed_tokens,
        num_generated_tokens=engine.num_generated_tokens,
        num_finished=engine.num_finished,
        grammar_mask_s=engine._grammar_mask_s,
    )
    if engine.scheduler.speculator is not None:
        spec = engine.scheduler.speculator.stats
        stats.spec_num_drafts, stats.spec_num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
        stats.spec_num_accepted_tokens = spec.num_accepted_tokens
        stats.spec_accepted_per_pos = tuple(spec.accepted_per_pos)
    return stats
