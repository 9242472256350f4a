"""StepLoop: the worker's side of the step protocol, once, for every executor and transport.

The gRPC Worker service (worker/worker_service.py: the Ray actors and the local TP processes) feeds it the
plans of its Step stream through serve(); the in-process executor (worker/inprocess.py) calls launch() and
finish() itself. What it guarantees:

- Plans run in submission order on every rank, and their answers go back in that order. Block reuse depends on
  this: the controller may free a block while a plan that writes it is still in flight and hand it to a later
  plan; running the plans in order makes the later write land last. This is the one place that keeps the order:
  launch() queues a plan's device work behind the earlier ones, finish() always finishes the oldest.
- Strict step ids: a plan is applied only when its id is exactly the last launched id + 1. Any other plan is
  refused and not applied; the rank stays ready (the refusal protected it, nothing in it broke).
- An exception in a step is different: this rank's state may be half-updated and its peers may be stuck in a
  collective with it, so the rank turns FAILED, the step is answered with the traceback and every later plan is
  refused. Never a silent death.
- One rank answers a step with its StepResult: rank 0, or with pipeline stages the last stage's first rank
  (proto/stages.py: result_rank); the other ranks sampled the same tokens (worker/sampler.py) or hold earlier
  stages, and answer with the step id and their forward_ms only.
- Launch-ahead (serve): after launching plan N, the loop takes plan N+1 only while N still runs on the device;
  if it arrives, N+1 is launched behind N before N's tokens are read back, so the device goes from one step to
  the next without waiting for this process (the engine sends N+1 before it collects N: async scheduling). If N
  finishes first, N is answered at once.

It knows nothing of sockets or protobuf: serve() takes any iterable of plans (with a decode function for wire
messages) and yields StepResult or StepRefusal answers for the caller to encode.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from shardserve.proto.plan import StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class StepRefusal:
    """The answer to a plan that was refused or failed on this rank: nothing of it is valid but the error."""

    step_id: int
    error: str  # names the rank and the step; a failure carries the traceback
    exception: BaseException | None = None  # the step's own exception where it raised (in-process re-raises it)

    def as_exception(self) -> BaseException:
        return self.exception if self.exception is not None else RuntimeError(self.error)


@dataclass(slots=True)
class _Launched:
    step_id: int
    handle: Any  # what runner.launch_step returned; on CUDA it has done()


class StepLoop:
    def __init__(self, runner: Any = None, rank: int = 0) -> None:
        self.runner = runner  # a ModelRunner with its KV cache allocated; None: not ready, every plan is refused
        self.rank = rank
        self.reports = rank == 0  # whether this rank's answers carry the sampled tokens (start() sets it)
        self.last_step_id = 0  # the last launched step
        self.error = ""  # set once a step (or the worker's start-up, via fail()) raised: the rank is FAILED
        self._launched: deque[_Launched] = deque()  # on the device, not finished yet; oldest first
        self._lock = threading.Lock()  # launch and finish are atomic (a second Step stream may probe the worker)

    def start(self, runner: Any, rank: int) -> None:
        """The runner is ready (KV cache allocated): plans may run from now on."""
        self.runner, self.rank = runner, rank
        self.reports = getattr(runner, "reports", rank == 0)

    def stop(self) -> None:
        """Drops the runner and whatever was launched; later plans are refused. Takes no lock: a step stuck in
        a collective holds it, and shutting down must still proceed."""
        self.runner = None
        self._launched.clear()

    def fail(self, error: str) -> None:
        """The worker failed outside a step (its start-up): FAILED, every plan is refused."""
        self.error = error

    @property
    def num_launched(self) -> int:
        return len(self._launched)

    # ---- one step ------------------------------------------------------------------------------------------
    def launch(self, plan: Any, decode: Callable[[Any], StepPlan] | None = None) -> StepRefusal | None:
        """Applies the plan and queues its device work behind the steps launched before it; None when launched.
        decode turns a wire message (which has .step_id) into the StepPlan; a decoding error fails the step."""
        with self._lock:
            refusal = self._refusal(plan.step_id)
            if refusal is not None:
                return refusal
            if plan.step_id != self.last_step_id + 1:
                return StepRefusal(plan.step_id, f"rank {self.rank} refuses step {plan.step_id}: expected step "
                                   f"{self.last_step_id + 1} (stale or out of order); the plan was not applied")
            try:
                handle = self.runner.launch_step(decode(plan) if decode is not None else plan)
            except Exception as exc:
                return self._failed(plan.step_id, exc)
            self.last_step_id = plan.step_id
            self._launched.append(_Launched(plan.step_id, handle))
            return None

    def finish(self) -> StepResult | StepRefusal:
        """Waits for the oldest launched step and answers it."""
        with self._lock:
            if not self._launched:
                raise RuntimeError("finish() without a launched step")
            launched = self._launched.popleft()
            refusal = self._refusal(launched.step_id)  # e.g. an earlier step failed after this one was launched
            if refusal is not None:
                return refusal
            try:
                result = self.runner.finish_step(launched.handle)
            except Exception as exc:
                return self._failed(launched.step_id, exc)
        if self.reports:
            return result
        return StepResult(launched.step_id, forward_ms=result.forward_ms)  # an acknowledgement

    def _refusal(self, step_id: int) -> StepRefusal | None:
        if self.error:
            why = f"this rank failed earlier: {self.error}"
            return StepRefusal(step_id, f"rank {self.rank} refuses step {step_id}: {why}")
        if self.runner is None:
            return StepRefusal(step_id, f"rank {self.rank} refuses step {step_id}: the worker is not ready")
        return None

    def _failed(self, step_id: int, exc: Exception) -> StepRefusal:
        """Called from an except block: this rank turns FAILED and refuses every later plan."""
        self.error = f"rank {self.rank} failed in step {step_id}: rank {self.rank} raised:\n{traceback.format_exc()}"
        return StepRefusal(step_id, self.error, exc)

    # ---- a stream of steps ---------------------------------------------------------------------------------
    def serve(self, plans: Iterable[Any], decode: Callable[[Any], StepPlan] | None = None
              ) -> Iterator[StepResult | StepRefusal]:
        """One answer per plan, in order, with launch-ahead. A reader thread queues the incoming plans; the
        stream ends when the plans do (a cancelled or broken stream ends them too)."""
        incoming: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_read_plans, args=(plans, incoming), name="step-plans", daemon=True).start()
        mine = 0  # steps this stream launched and has not answered

        def answer(keep: int) -> Iterator[StepResult | StepRefusal]:
            """Answers this stream's launched steps, oldest first, until `keep` are left."""
            nonlocal mine
            while mine > keep:
                mine -= 1
                yield self.finish()

        try:
            while True:
                if mine:
                    plan = _next_plan_while_running(incoming, self._launched[0].handle)
                    if plan is None:  # the launched step finished first: answer it now
                        yield from answer(0)
                        continue
                else:
                    plan = incoming.get()
                if plan is _END:
                    yield from answer(0)
                    return
                refusal = self.launch(plan, decode)
                if refusal is not None:
                    yield from answer(0)  # answered in order: after the steps launched before it
                    yield refusal
                    continue
                mine += 1
                yield from answer(1)  # plan N+1 is queued behind N on the device: now answer N
        finally:
            for _ in range(mine):  # the stream ended or was cancelled: finish what it launched (unanswered)
                if self.num_launched:  # stop() may have dropped them already
                    self.finish()


_END = object()  # the plans ended (or the stream was cancelled)


def _read_plans(plans: Iterable[Any], incoming: queue.SimpleQueue) -> None:
    try:
        for plan in plans:
            incoming.put(plan)
    except Exception:  # cancelled or broken stream: the loop ends after what it has
        pass
    finally:
        incoming.put(_END)


def _next_plan_while_running(incoming: queue.SimpleQueue, handle: Any, poll_s: float = 0.0002) -> Any:
    """The next queued plan, waited for only while the launched step still runs on the device; None if it
    finished first (CPU steps are finished at launch: then only a plan already queued is taken)."""
    done = getattr(handle, "done", None)
    while True:
        try:
            return incoming.get_nowait() if done is None or done() else incoming.get(timeout=poll_s)
        except queue.Empty:
            if done is None or done():
                return None
