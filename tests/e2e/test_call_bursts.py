"""A burst of calls on one channel (a batch client, a gateway, a load balancer's pooled connection): gRPC core
cancels calls at random once more than its pending-call limit (1,000 by default) wait for the server's application
to take them. The server raises that limit above its own admission limit, so every call of a burst is answered
(served, or refused by the controller with RESOURCE_EXHAUSTED), never CANCELLED. Real controller, real gRPC on
127.0.0.1, the tiny model."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shardserve.client.clients import AsyncClient
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


def test_a_burst_of_streams_past_the_admission_limit_is_served_or_refused_never_cancelled(tiny_llama_dir, e2e_config):
    """max_live_requests 32 and 1,500 streams at once on one channel: each one ends with its token or with the
    controller's RESOURCE_EXHAUSTED (retryable), at least 32 are served, and the server serves afterwards."""
    served = _serve(e2e_config, tiny_llama_dir, ApiSecurity(), max_live_requests=32)
    try:
        async def burst() -> list:
            async with AsyncClient(served.address, timeout=120) as client:
                async def one(i: int):
                    return await client.generate([1 + i % 300, 2, 3], max_tokens=1, temperature=0)
                return await asyncio.gather(*(one(i) for i in range(1500)), return_exceptions=True)

        results = asyncio.run(burst())
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        others = [r for r in results if isinstance(r, BaseException) and not isinstance(r, grpc.RpcError)]
        assert not others, others[:3]
        assert {r.code() for r in refused} <= {grpc.StatusCode.RESOURCE_EXHAUSTED}, {r.code() for r in refused}
        answered = [r for r in results if not isinstance(r, BaseException)]
        assert len(answered) >= 32 and all(len(r.token_ids) == 1 for r in answered)
        assert len(answered) + len(refused) == 1500
        after = asyncio.run(_one_generate(served.address))
        assert len(after.token_ids) == 4
    finally:
        served.close()


async def _one_generate(address: str):
    async with AsyncClient(address, timeout=60) as client:
        return await client.generate([5, 6, 7], max_tokens=4, temperature=0)


def test_the_pending_call_limits_sit_above_the_admission_limit():
    soft, hard = pending_call_limits(4096)
    assert 4096 < soft < hard
    assert pending_call_limits(10)[0] >= 8 * 1000  # far above gRPC's own 1,000 whatever the admission limit
