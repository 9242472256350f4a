"""EngineLoop.stop racing submit(): every submitted future is resolved (run, or failed with RuntimeError), none
left pending behind the stop (a request admitted at that moment would wait forever, and its stream with it)."""

import queue
import threading
import time
from concurrent.futures import wait

from _fake_executor import FakeExecutor

from shardserve.cluster.engine import Engine
from shardserve.cluster.engine_loop import EngineLoop
from shardserve.proto.config import EngineConfig


class SlowToQueue:
    """The loop's command queue, where a submitter thread's put takes 50 ms: the moment between submit() deciding
    the loop runs and the command being queued, widened so that a stop lands inside it."""

    def __init__(self, submitter: str):
        self.inner, self.submitter = queue.SimpleQueue(), submitter
        self.entered = threading.Event()

    def put(self, item) -> None:
        if threading.current_thread().name == self.submitter:
            self.entered.set()
            time.sleep(0.05)
        self.inner.put(item)

    def get(self, *args, **kwargs):
        return self.inner.get(*args, **kwargs)

    def get_nowait(self):
        return self.inner.get_nowait()


def test_a_command_submitted_while_the_loop_stops_is_run_or_failed_never_left_pending():
    engine = Engine(EngineConfig(model="fake", block_size=4, max_model_len=64), FakeExecutor(16, 4, 100), None, (),
                    vocab_size=100)
    loop = EngineLoop(engine, on_step=lambda report: None, on_failure=lambda error: None)
    loop._commands = commands = SlowToQueue("submitter")
    loop.start()
    futures = []
    submitter = threading.Thread(target=lambda: futures.append(loop.submit(lambda engine: "ran")), name="submitter")
    submitter.start()
    assert commands.entered.wait(10)
    loop.stop(timeout=10)  # while the submit is between its check and its put
    submitter.join(10)
    done, pending = wait(futures, timeout=10)
    assert len(futures) == 1 and not pending, "a submitted command was queued behind the stop and never resolved"
    (future,) = done
    assert future.exception() is None and future.result() == "ran" or isinstance(future.exception(), RuntimeError)
