"""The worker's step loop on a fake runner (no model, no sockets): strict step ids, a failing step fails the rank,
ranks other than 0 acknowledge, answers keep submission order, and launch-ahead queues plan N+1 behind N."""

from __future__ import annotations

import threading

import pytest

from shardserve.proto.plan import StepPlan, StepResult
from shardserve.worker.step_loop import StepLoop, StepRefusal


class FakeHandle:
    def __init__(self, step_id: int, running: bool) -> None:
        self.step_id = step_id
        self.running = threading.Event()
        if running:
            self.running.set()

    def done(self) -> bool:
        return not self.running.is_set()


class FakeRunner:
    """Records launch/finish order; a plan naming "boom" raises; launched steps run until released (on_device)."""

    def __init__(self, on_device: bool = False) -> None:
        self.on_device = on_device
        self.events: list[tuple[str, int]] = []
        self.handles: list[FakeHandle] = []

    def launch_step(self, plan: StepPlan) -> FakeHandle:
        if "boom" in plan.req_ids:
            raise KeyError("boom has no state")
        self.events.append(("launch", plan.step_id))
        handle = FakeHandle(plan.step_id, self.on_device)
        self.handles.append(handle)
        return handle

    def finish_step(self, handle: FakeHandle) -> StepResult:
        self.events.append(("finish", handle.step_id))
        return StepResult(handle.step_id, req_ids=["r"], token_ids=[handle.step_id], forward_ms=1.5)


def test_a_plan_out_of_order_is_refused_not_applied_and_the_rank_stays_ready():
    runner = FakeRunner()
    loop = StepLoop(runner)
    refusal = loop.launch(StepPlan(3))
    assert isinstance(refusal, StepRefusal) and "refuses step 3: expected step 1" in refusal.error
    assert runner.events == [] and loop.last_step_id == 0 and not loop.error
    assert loop.launch(StepPlan(1)) is None
    assert loop.launch(StepPlan(1)).error.endswith("(stale or out of order); the plan was not applied")
    assert loop.finish().token_ids == [1]


def test_an_exception_in_a_step_fails_the_rank_and_every_later_plan_is_refused():
    loop = StepLoop(FakeRunner(), rank=1)
    failure = loop.launch(StepPlan(1, req_ids=["boom"], num_tokens=[1]))
    assert isinstance(failure.exception, KeyError)
    assert failure.error.startswith("rank 1 failed in step 1: rank 1 raised:\nTraceback") and "boom" in failure.error
    assert loop.error == failure.error and loop.last_step_id == 0
    later = loop.launch(StepPlan(1))
    assert "rank 1 refuses step 1: this rank failed earlier" in later.error and later.exception is None


def test_a_plan_before_the_runner_is_ready_is_refused():
    loop = StepLoop()
    assert "the worker is not ready" in loop.launch(StepPlan(1)).error
    with pytest.raises(RuntimeError, match="without a launched step"):
        loop.finish()


def test_rank_zero_answers_with_its_result_and_other_ranks_acknowledge():
    rank0, rank1 = StepLoop(FakeRunner(), rank=0), StepLoop(FakeRunner(), rank=1)
    for loop in (rank0, rank1):
        assert loop.launch(StepPlan(1)) is None
    assert rank0.finish() == StepResult(1, req_ids=["r"], token_ids=[1], forward_ms=1.5)
    assert rank1.finish() == StepResult(1, forward_ms=1.5)


def test_served_answers_keep_submission_order_around_a_refusal():
    runner = FakeRunner()
    answers = list(StepLoop(runner).serve([StepPlan(1), StepPlan(2), StepPlan(5), StepPlan(3)]))
    assert [a.step_id for a in answers] == [1, 2, 5, 3]
    assert [isinstance(a, StepRefusal) for a in answers] == [False, False, True, False]
    # Queued plans are taken at once (launch-ahead): 2 is launched before 1 is answered; 5 waits for 2's answer.
    assert runner.events == [("launch", 1), ("launch", 2), ("finish", 1), ("finish", 2), ("launch", 3), ("finish", 3)]


def test_the_next_plan_is_launched_behind_a_running_step_before_its_answer():
    """Plan 2 arrives while step 1 still runs on the device: 2 is launched, then 1 is answered. Step 2 finishes
    before plan 3 arrives: 2 is answered at once, without waiting for a plan."""
    runner = FakeRunner(on_device=True)
    sent = threading.Semaphore(0)

    def plans():
        yield StepPlan(1)
        yield StepPlan(2)
        sent.acquire()  # plan 3 only once step 2 is answered
        yield StepPlan(3)

    answers = StepLoop(runner).serve(plans(), decode=lambda plan: plan)
    assert next(answers).step_id == 1  # step 1 never completes here: the loop waits for plan 2 meanwhile
    assert runner.events == [("launch", 1), ("launch", 2), ("finish", 1)]
    runner.handles[1].running.clear()  # step 2 completes on the device with no plan waiting
    assert next(answers).step_id == 2
    assert runner.events[-1] == ("finish", 2)
    runner.on_device = False  # step 3 is done when launched (as on CPU)
    sent.release()
    assert next(answers).step_id == 3
    assert list(answers) == []
    assert runner.events[-2:] == [("launch", 3), ("finish", 3)]
