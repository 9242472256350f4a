"""A burst of calls on one channel (a batch client, a gateway, a load balancer's pooled connection): gRPC core
cancels calls at random once more than its pending-call limit (1,000 by default) wait for the server's application
to take them. The server raises that limit above its own admission limit, so every call of a burst is answered
(served, or refused by the controller with RESOURCE_EXHAUSTED), never CANCELLED. Real controller, real gRPC on
127.0.0.1, the tiny model."""

from __future__ import annotations

import asyncio

import pytest

from shardserve.client import AsyncClient
from shardserve.cluster.api_security import ApiSecurity, pending_call_limits
from tests.e2e.test_client_security import _serve

BURST = 3000  # three times gRPC's default soft limit: before the limit was raised, ~10-20% of such a burst failed


@pytest.fixture(scope="module")
def server(tiny_llama_dir, e2e_config):
    served = _serve(e2e_config, tiny_llama_dir, ApiSecurity())
    yield served
    served.close()


def test_a_burst_of_calls_on_one_channel_is_answered_in_full(server):
    async def burst() -> list:
        async with AsyncClient(server.address, timeout=120) as client:
            await client.model_info()
            return await asyncio.gather(*(client.model_info() for _ in range(BURST)), return_exceptions=True)

    results = asyncio.run(burst())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {BURST} calls failed, e.g. {failed[0]!r}"
    assert all(r.max_model_len == 256 for r in results)


def test_the_pending_call_limits_sit_above_the_admission_limit():
    soft, hard = pending_call_limits(4096)
    assert 4096 < soft < hard
    assert pending_call_limits(10) == (1000, 2000)  # never below gRPC's own soft default
