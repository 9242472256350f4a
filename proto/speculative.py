"""SpeculativeConfig: the speculative-decoding settings, in vLLM's shape.

A user gives them as a dict (`LLM(speculative_config={...})`) or its JSON text (`--speculative-config '{...}'`);
EngineConfig.speculative_config carries the normalised JSON text (every key filled in), so the one settings
message reaches every worker unchanged. `parse_speculative_config` is the one reader and checker of both forms.

Keys:
- method: "ngram" (prompt lookup: the request's last n tokens, prompt_lookup_max >= n >= prompt_lookup_min,
  looked up in its own prompt and output, and the tokens that followed them proposed);
- num_speculative_tokens: k, the tokens proposed per request and step (each verified in the same forward);
- prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried, longest first;
- disable_by_batch_size: a step with at least this many running requests proposes nothing (the verification's
  extra rows cost more than they win once a batch is large; docs/performance.md has the measurement).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram",)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8  # CPU, the default model: see docs/performance.md (speculation and batch size)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}; got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


_KEYS = tuple(f.name for f in fields(SpeculativeConfig))


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """A dict or its JSON text -> SpeculativeConfig (None or an empty text: no speculation). ValueError names what
    is wrong: not JSON, not an object, an unknown key, a value out of range."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; the keys are {', '.join(_KEYS)}")
    if "method" not in value:
        raise ValueError("speculative_config needs a method (ngram)")
    return SpeculativeConfig(**value)
