"""StepDeadline: how long the controller waits for a step before it declares the TP group hung.

A stopped worker (SIGSTOP, a wedged collective, a device hang) answers nothing: no error, no closed stream. The
only sign is time. A fixed timeout is either too long (torch's 30-minute default; a minute of silence while health
says SERVING) or too short for a long prefill, so the deadline follows the measured step times:

    deadline(step) = max(floor_s, factor * p(recent step times), factor * p(recent time per token) * step tokens)

p is a high percentile (the 99th) over the last `window` steps. The per-token term keeps a large prefill chunk
that follows a run of decodes from looking hung; the floor keeps a burst of fast steps from making the deadline
tight enough for scheduling noise to trip it. Until `min_samples` steps were measured, `initial_s` applies (the
first steps run right after ProfileMemory, which already ran the largest batch, so they are not slow).

A step's time is measured from when the workers could start it (its submission, or the previous step's end when
it was queued behind that one) to its last rank's answer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class StepDeadline:
    floor_s: float = 10.0  # never less
    factor: float = 10.0  # x the recent high percentile
    initial_s: float = 30.0  # before min_samples steps were measured
    min_samples: int = 8
    window: int = 256
    quantile: float = 0.99
    _seconds: deque = field(default_factory=deque, init=False, repr=False)
    _per_token: deque = field(default_factory=deque, init=False, repr=False)

    def fresh(self) -> StepDeadline:
        """The same settings with no measurements (for a new group)."""
        return replace(self)

    def __post_init__(self) -> None:
        if self.floor_s <= 0 or self.factor < 1 or self.initial_s <= 0:
            raise ValueError(f"step deadline: need floor_s > 0, factor >= 1, initial_s > 0; got {self}")

    def observe(self, seconds: float, num_tokens: int) -> None:
        """Records a finished step's time (its measured duration and its batched tokens)."""
        self._seconds.append(seconds)
        self._per_token.append(seconds / max(num_tokens, 1))
        if len(self._seconds) > self.window:
            self._seconds.popleft()
            self._per_token.popleft()

    def seconds_for(self, num_tokens: int) -> float:
        """The deadline for a step of num_tokens batched tokens."""
        if len(self._seconds) < self.min_samples:
            return max(self.initial_s, self.floor_s)
        by_step = _percentile(list(self._seconds), self.quantile)
        by_token = _percentile(list(self._per_token), self.quantile) * max(num_tokens, 1)
        return max(self.floor_s, self.factor * max(by_step, by_token))
