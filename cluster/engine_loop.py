"""EngineLoop: the one thread that owns the Engine (and its tokenizer) and runs its steps.

An engine step blocks on the workers for the whole forward pass, so it never runs on the controller's event loop
(the gRPC server must keep answering health checks and new requests meanwhile). The Engine and the tokenizer are
not thread-safe, so every other access goes through `submit`: a callable queued to this thread and run between
two steps, its result or exception coming back in a concurrent Future. Invariant: only this thread touches the
Engine and the tokenizer.

A lost TP group (WorkerError from a step, or `group_lost` from the health probe) is restarted when the loop was
given a RestartPolicy with its executor factory: on_group_lost is called at once (health NOT_SERVING), a
background thread builds a new executor (a fresh group) with a bounded number of tries and backoff, and meanwhile
this thread keeps running commands (admissions queue, aborts and stats answer) but takes no step. When the new
executor is ready the engine resumes every live request on it (Engine.restart) and on_group_back is called; when
every try failed the loop fails as it does without a policy (on_failure: live requests end with UNAVAILABLE).
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from shardserve.cluster.engine import Engine, EngineStats
from shardserve.cluster.executor import Executor, WorkerError
from shardserve.cluster.outputs import RequestDelta

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepReport:
    """What one step produced, handed to the event loop."""

    deltas: list[RequestDelta]
    step_s: float  # wall time of engine.step()
    stats: EngineStats  # after the step
    block_events: list[tuple[int, bool]]  # the prefix cache's (hash, stored) events of this step, for the router
    # (recorded where the engine's config.block_events is on, as a server replica's is)


@dataclass
class RestartPolicy:
    """How a lost TP group is replaced: make_executor() starts a new group (tearing the old one down first) and
    returns its executor, ready; tried up to max_tries times, waiting backoff_s, then twice as long each time."""

    make_executor: Callable[[], Executor]
    max_tries: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 15.0
    on_group_lost: Callable[[BaseException], None] = lambda error: None  # called on the loop thread: hand over
    on_group_back: Callable[[], None] = lambda: None
    stop_timeout_s: float = 2.0  # for the failed group's shutdown calls: its ranks may be dead or stopped


def _stop_quickly(executor: Executor, timeout_s: float) -> None:
    """Shuts a failed executor (and the group it owns) down, with short timeouts where it takes one."""
    try:
        if "timeout_s" in inspect.signature(executor.shutdown).parameters:
            executor.shutdown(timeout_s=timeout_s)
        else:
            executor.shutdown()
    except Exception:
        log.exception("stopping the failed TP group")


class _GiveUp(Exception):
    """Every restart try failed: the loop fails with the last error."""


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_step: Callable[[StepReport], None],
        on_failure: Callable[[BaseException], None],
        restart: RestartPolicy | None = None,
    ) -> None:
        """on_step and on_failure (and the policy's callbacks) are called on this loop's thread; they must only
        hand work over (e.g. with loop.call_soon_threadsafe)."""
        self.engine = engine
        self._on_step = on_step
        self._on_failure = on_failure
        self._restart = restart
        self.recovering = False  # a lost group is being replaced: no step runs until it is back
        self._give_up: BaseException | None = None
        self._commands: queue.SimpleQueue[tuple[Callable, Future] | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._stopped = False
        # Held to queue a command and to stop or fail the loop, so nothing is queued after the thread's last look at
        # the queue: every submitted future is resolved (a command queued behind the stop would wait forever).
        self._queue_lock = threading.Lock()
        self._stopping = threading.Event()  # wakes the restart thread's backoff
        self._thread = threading.Thread(target=self._run, name="shardserve-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, fn: Callable[[Engine], object]) -> Future:
        """Runs fn(engine) on the loop thread before the next step."""
        future: Future = Future()
        if not self._queue((fn, future)):
            future.set_exception(RuntimeError(f"the engine loop is not running ({self._failed or 'stopped'})"))
        return future

    def _queue(self, command: tuple[Callable, Future]) -> bool:
        """Queues a command unless the loop has stopped or failed; False then."""
        with self._queue_lock:
            if self._failed is not None or self._stopped:
                return False
            self._commands.put(command)
            return True

    def group_lost(self, error: BaseException) -> None:
        """The health probe found a rank gone while no step noticed (an idle server): handled as a failed step."""
        def lost(engine: Engine) -> None:
            if not self.recovering:
                self._lose_group(WorkerError(str(error)))

        self.submit(lost)

    def stop(self, timeout: float | None = None) -> None:
        """Stops after the current step; commands still queued fail."""
        with self._queue_lock:
            self._stopped = True
            self._commands.put(None)  # the last item: every command queued is run or failed before the thread ends
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Idle or recovering: sleep until a command arrives. Busy: take whatever is queued and step again.
                busy = self.engine.has_unfinished() and not self.recovering
                item = self._get_nowait() if busy else self._commands.get()
                while item is not ...:
                    if item is None:
                        return self._fail_queued(RuntimeError("the engine loop stopped"))
                    fn, future = item
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn(self.engine))
                        except BaseException as e:  # a ValueError from Engine.admit belongs to that caller only
                            future.set_exception(e)
                    item = self._get_nowait()
                if self._give_up is not None:
                    raise self._give_up
                if self.engine.has_unfinished() and not self.recovering:
                    try:
                        self._step()
                    except WorkerError as e:
                        self._lose_group(e)
        except BaseException as e:  # a worker failed (or a bug): every request on this engine is lost
            log.exception("engine loop failed")
            with self._queue_lock:
                self._failed = e
            self._fail_queued(e)
            self._on_failure(e)

    # ---- a lost group ---------------------------------------------------------------------------------------
    def _lose_group(self, error: WorkerError) -> None:
        """Without a policy the error fails the loop; with one, a new group is started in the background."""
        if self._restart is None:
            raise error
        log.error("the TP group failed (%s): restarting it", error)
        self.recovering = True
        self._restart.on_group_lost(error)
        threading.Thread(target=self._replace_group, args=(error,), name="shardserve-group-restart", daemon=True).start()

    def _replace_group(self, error: BaseException) -> None:
        """The restart thread: stops the failed group (its GPUs may be what the new one needs), then tries
        make_executor with backoff; hands the result to the loop thread. Only this thread touches the old
        executor now: the loop takes no step while recovering."""
        policy = self._restart
        _stop_quickly(self.engine.executor, policy.stop_timeout_s)
        wait_s = policy.backoff_s
        for attempt in range(1, policy.max_tries + 1):
            if self._stopped:
                return
            try:
                executor = policy.make_executor()
            except Exception as e:
                log.exception("restarting the TP group: try %d of %d failed", attempt, policy.max_tries)
                error = e
                if attempt < policy.max_tries and not self._stopping.wait(wait_s):
                    wait_s = min(2 * wait_s, policy.max_backoff_s)
                continue
            if not self._queue((lambda engine, ex=executor: self._resume(ex), Future())):
                executor.shutdown()  # stopped meanwhile: the new group is nobody's
            return
        why = _GiveUp(f"the TP group could not be restarted in {policy.max_tries} tries: {error!r}")
        self._queue((lambda engine: self._fail_restart(why), Future()))

    def _resume(self, executor: Executor) -> None:
        self.engine.restart(executor)
        self.recovering = False
        log.warning("the TP group is back: %d live request(s) resume", len(self.engine.scheduler.requests))
        self._restart.on_group_back()

    def _fail_restart(self, error: BaseException) -> None:
        self._give_up = error

    def _get_nowait(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return ...

    def _step(self) -> None:
        start = time.perf_counter()
        deltas = self.engine.step()
        step_s = time.perf_counter() - start
        for delta in deltas:
            if delta.finished:
                self.engine.pop_output(delta.request_id)  # the stream has everything; free the id
        self._on_step(StepReport(deltas, step_s, self.engine.stats(), self.engine.take_block_events()))

    def _fail_queued(self, error: BaseException) -> None:
        while (item := self._get_nowait()) is not ...:
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(error)
