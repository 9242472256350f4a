"""Placing and starting a worker group blocks on Ray for seconds: on an event loop's thread (the controller's) it
would stall every stream, so the launcher refuses there, before it touches Ray. (Off the loop, as the controller
calls it through asyncio.to_thread, every cluster test goes through it.)"""

import asyncio

import pytest

from shardserve.launch.placement import launch_worker_group, place_group
from shardserve.proto.config import EngineConfig

CONFIG = EngineConfig(model="unused", tensor_parallel_size=2)


@pytest.mark.parametrize("call", [lambda: place_group(CONFIG), lambda: launch_worker_group(CONFIG)],
                         ids=["place_group", "launch_worker_group"])
def test_a_blocking_launch_on_the_event_loop_is_refused(call):
    async def on_the_loop():
        call()

    with pytest.raises(RuntimeError, match="off the event loop"):
        asyncio.run(on_the_loop())

