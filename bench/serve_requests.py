"""The requests of `shardserve bench serve`: what is sent (BenchRequest), how (over gRPC or the HTTP gateway), when
(Poisson arrivals at a rate, or a fixed concurrency), and what each one measured (RequestResult)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field


@dataclass
class BenchRequest:
    prompt: str | list[int] | list[dict]  # text, token ids or chat messages
    output_len: int
    input_len: int | None = None  # as generated (token ids); the server's count comes back in the usage


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None  # send -> first generated token
    itl_s: list[float] = field(default_factory=list)  # between successive token-bearing messages
    e2e_s: float | None = None

    def token_arrived(self, start: float, last: float) -> float:
        """A message with new tokens arrived: the first gives TTFT, later ones an inter-token gap. Returns now."""
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - start
        else:
            self.itl_s.append(now - last)
        return now

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class GrpcSender:
    """Streams each request over one AsyncClient (one channel), as a gRPC user would."""

    name = "grpc"

    def __init__(self, address: str, sampling: dict) -> None:
        from shardserve.client.clients import AsyncClient

        self.client = AsyncClient(address)
        self.sampling = sampling

    async def __call__(self, req: BenchRequest) -> RequestResult:
        import grpc

        result = RequestResult()
        start = last = time.perf_counter()
        try:
            stream = self.client.stream(req.prompt, max_tokens=req.output_len, **self.sampling)
            async for delta in stream:
                if delta.token_ids:
                    last = result.token_arrived(start, last)
            result.e2e_s = time.perf_counter() - start
            usage = stream.result.usage
            result.prompt_tokens, result.output_tokens = usage.prompt_tokens, usage.completion_tokens
            result.ok = result.ttft_s is not None
        except grpc.RpcError as e:
            result.error = f"{e.code().name}: {e.details()}"
        return result

    async def close(self) -> None:
        await self.client.close()


class HttpSender:
    """Streams each request through the gateway's OpenAI API (SSE), with return_token_ids so that token-id-only
    models show their tokens, and include_usage for the counts."""

    name = "http"

    def __init__(self, base_url: str, sampling: dict) -> None:
        from shardserve.bench.sse_client import SseClient

        self.client = SseClient(base_url.rstrip("/").removesuffix("/v1"))
        self.sampling = sampling

    async def __call__(self, req: BenchRequest) -> RequestResult:
        from shardserve.bench.sse_client import HttpError

        chat = isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], dict)
        payload = {"messages" if chat else "prompt": req.prompt, "max_tokens": req.output_len, "stream": True,
                   "stream_options": {"include_usage": True}, "return_token_ids": True, **self.sampling}
        result = RequestResult()
        start = last = time.perf_counter()
        try:
            async for data in self.client.events("/v1/chat/completions" if chat else "/v1/completions", payload):
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"{chunk['error']['code']}: {chunk['error']['message']}"
                    return result
                if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                    last = result.token_arrived(start, last)
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
            result.e2e_s = time.perf_counter() - start
            result.ok = result.ttft_s is not None
        except (HttpError, OSError, ValueError, asyncio.IncompleteReadError) as e:
            result.error = str(e)
        return result

    async def close(self) -> None:
        await self.client.close()


async def run_requests(send, requests: list[BenchRequest], rate: float, max_concurrency: int | None,
                       burstiness: float = 1.0, seed: int = 0, desc: str = "requests"
                       ) -> tuple[list[RequestResult], float]:
    """Sends every request, arrivals a Poisson process at `rate` per second (gamma with shape `burstiness`; inf:
    all at once), at most max_concurrency in flight. Returns the results in request order and the duration."""
    from tqdm import tqdm

    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)

    async def one(req: BenchRequest) -> RequestResult:
        async with gate:
            result = await send(req)
        bar.update(1)
        return result

    tasks = []
    start = time.perf_counter()
    try:
        for i, req in enumerate(requests):
            tasks.append(asyncio.ensure_future(one(req)))
            if not math.isinf(rate) and i + 1 < len(requests):
                await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
        results = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    return results, time.perf_counter() - start
