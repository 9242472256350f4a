"""Speculative decoding on the controller: proposing draft tokens, and counting how many the workers accepted.

The n-gram proposer (prompt lookup) needs nothing but a request's own tokens, which the controller has: each step
it looks up the request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) among its earlier
tokens (prompt and output) and proposes the tokens that followed the latest earlier occurrence. The scheduler
sends the proposals in the plan (StepPlan.draft_token_ids); the workers verify them in one forward
(worker/spec_verify.py) and report the tokens kept.

Per step this is O(new tokens) per request: an index per n-gram length maps each n-gram to the position after its
latest occurrence and is extended only by the tokens appended since the last lookup (the prompt is indexed once,
at the request's first lookup).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.proto.speculative import SpeculativeConfig


class NgramIndex:
    """One request's n-gram index: for each n in [n_min, n_max], n-gram -> the position right after its latest
    occurrence that has a token after it (so a hit always has a continuation to propose)."""

    __slots__ = ("n_min", "n_max", "maps", "indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]
        self.indexed = 0  # continuation positions < indexed are in the maps

    def extend(self, tokens: list[int]) -> None:
        """Indexes every n-gram that ends before the last token (its continuation is known)."""
        maps, n_min, n_max = self.maps, self.n_min, self.n_max
        for end in range(max(self.indexed, 1), len(tokens)):  # tokens[end] follows the n-grams ending at end - 1
            for n in range(n_min, min(n_max, end) + 1):
                maps[n][tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram found."""
        self.extend(tokens)
        size = len(tokens)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            start = self.maps[n].get(tuple(tokens[size - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's speculative-decoding counters: drafts proposed, draft tokens, accepted tokens, and accepted tokens
    per draft position (position i counts the drafts whose first i + 1 tokens were all accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step gains on average: 1 + accepted drafts (vLLM's mean acceptance length)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """The scheduler's proposer: draft tokens for a request about to decode, within its limits."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats()

    def active(self, num_running: int) -> bool:
        """Whether this step proposes at all: not once the batch is large (disable_by_batch_size)."""
        return num_running < self.config.disable_by_batch_size

    def propose(self, seq, limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens to follow seq.token_ids (a cluster.request.Request)."""
        k = min(self.config.num_speculative_tokens, limit)
        if k <= 0:
            return []
        index = seq.draft_index
        if index is None:
            index = seq.draft_index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        return index.propose(seq.token_ids, k)
