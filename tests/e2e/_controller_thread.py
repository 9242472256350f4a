"""A Controller on an event loop of its own thread (as a Ray actor runs it), for tests that use blocking clients."""

from __future__ import annotations

import asyncio
import threading

from shardserve.cluster.controller import Controller, ControllerConfig


class ControllerThread:
    """A Controller on its own event loop thread; the test thread uses blocking clients against it."""

    def __init__(self, config: ControllerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.controller = Controller(config)
        self.address = self.call(self.controller.start())

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.controller.shutdown(0.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
