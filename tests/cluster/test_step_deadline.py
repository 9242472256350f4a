"""The step deadline follows the measured step times: never below its floor, scaled to a step's tokens."""

from __future__ import annotations

import pytest

from shardserve.cluster.step_deadline import StepDeadline


def test_before_enough_steps_are_measured_the_initial_deadline_applies():
    deadline = StepDeadline(floor_s=2.0, initial_s=30.0, min_samples=4)
    for _ in range(3):
        deadline.observe(0.01, 1)
    assert deadline.seconds_for(1) == 30.0
    deadline.observe(0.01, 1)
    assert deadline.seconds_for(1) == 2.0  # fast steps: the floor, not 10 x 0.01 s


def test_slow_steps_raise_the_deadline_to_factor_times_their_high_percentile():
    deadline = StepDeadline(floor_s=1.0, factor=10.0, min_samples=1)
    for _ in range(100):
        deadline.observe(0.5, 1)
    assert deadline.seconds_for(1) == pytest.approx(5.0)


def test_a_large_prefill_after_decodes_gets_time_in_proportion_to_its_tokens():
    deadline = StepDeadline(floor_s=1.0, factor=10.0, min_samples=1)
    for _ in range(50):
        deadline.observe(0.2, 16)  # decodes of 16 requests: 12.5 ms per token
    assert deadline.seconds_for(16) == pytest.approx(2.0)
    assert deadline.seconds_for(2048) == pytest.approx(10.0 * 0.2 / 16 * 2048)


def test_only_the_recent_window_counts():
    deadline = StepDeadline(floor_s=1.0, factor=10.0, min_samples=1, window=8)
    for _ in range(8):
        deadline.observe(5.0, 1)
    for _ in range(8):
        deadline.observe(0.01, 1)
    assert deadline.seconds_for(1) == 1.0


@pytest.mark.parametrize("bad", [dict(floor_s=0.0), dict(factor=0.5), dict(initial_s=-1.0)])
def test_nonsense_settings_are_refused(bad):
    with pytest.raises(ValueError):
        StepDeadline(**bad)
