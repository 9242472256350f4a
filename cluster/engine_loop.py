"""EngineLoop: the one thread that owns the Engine (and its tokenizer) and runs its steps.

An engine step blocks on the workers for the whole forward pass, so it never runs on the controller's event loop
(the gRPC server must keep answering health checks and new requests meanwhile). The Engine and the tokenizer are
not thread-safe, so every other access goes through `submit`: a callable queued to this thread and run between
two steps, its result or exception coming back in a concurrent Future. Invariant: only this thread touches the
Engine and the tokenizer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from shardserve.cluster.engine import Engine, EngineStats
from shardserve.cluster.outputs import RequestDelta

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepReport:
    """What one step produced, handed to the event loop."""

    deltas: list[RequestDelta]
    step_s: float  # wall time of engine.step()
    stats: EngineStats  # after the step


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_step: Callable[[StepReport], None],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        """on_step and on_failure are called on this loop's thread; they must only hand work over (e.g. with
        loop.call_soon_threadsafe)."""
        self.engine = engine
        self._on_step = on_step
        self._on_failure = on_failure
        self._commands: queue.SimpleQueue[tuple[Callable, Future] | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="shardserve-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, fn: Callable[[Engine], object]) -> Future:
        """Runs fn(engine) on the loop thread before the next step."""
        future: Future = Future()
        if self._failed is not None or self._stopped:
            future.set_exception(RuntimeError(f"the engine loop is not running ({self._failed or 'stopped'})"))
        else:
            self._commands.put((fn, future))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Stops after the current step; commands still queued fail."""
        self._stopped = True
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Idle: sleep until a command arrives. Busy: take whatever is queued and step again.
                item = self._commands.get() if not self.engine.has_unfinished() else self._get_nowait()
                while item is not ...:
                    if item is None:
                        return self._fail_queued(RuntimeError("the engine loop stopped"))
                    fn, future = item
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn(self.engine))
                        except BaseException as e:  # a ValueError from add_request belongs to that caller only
                            future.set_exception(e)
                    item = self._get_nowait()
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # a worker failed (or a bug): every request on this engine is lost
            log.exception("engine loop failed")
            self._failed = e
            self._fail_queued(e)
            self._on_failure(e)

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
        self._on_step(StepReport(deltas, step_s, self.engine.stats()))

    def _fail_queued(self, error: BaseException) -> None:
        while (item := self._get_nowait()) is not ...:
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(error)
