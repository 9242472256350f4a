"""A fake, fast gRPC upstream for measuring the HTTP gateway's own cost (no model, no engine):

    python -m shardserve.bench.serve_fake --port 50051 [--step-ms 0]

It answers Generate as the server does (Started, one Delta per token, Finished with the usage), max_tokens tokens
(default 16) of text " tok", and ModelInfo / ServerStats / health. --step-ms > 0 paces the tokens like an engine:
every stream gets its next token on a shared tick of that period (a decode step of a batch); 0 sends them as fast
as the process can. Pointing `shardserve bench serve --address` at it, then `--http` at a gateway in front of it,
gives the gateway's cost per request and per token with the engine taken out.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

from shardserve.cluster.api_security import ApiSecurity
from shardserve.proto import generation_pb2 as pb
from shardserve.proto import generation_pb2_grpc as pb_grpc


class FakeGeneration(pb_grpc.GenerationServicer):
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.tick: asyncio.Event | None = None

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self.tick.set()
            self.tick = asyncio.Event()

    async def Generate(self, request, context):
        if self.step_s and self.tick is None:
            self.tick = asyncio.Event()
            asyncio.get_running_loop().create_task(self._ticker())
        n = request.max_tokens if request.HasField("max_tokens") else 16
        prompt_tokens = len(request.token_ids.ids) if request.HasField("token_ids") else len(request.text.split()) + 1
        yield pb.GenerateResponse(started=pb.GenerateResponse.Started(request_id=request.request_id,
                                                                      prompt_token_count=prompt_tokens))
        for i in range(n):
            if self.step_s:
                await self.tick.wait()
            yield pb.GenerateResponse(delta=pb.GenerateResponse.Delta(text=" tok", token_ids=[i + 5]))
        yield pb.GenerateResponse(finished=pb.GenerateResponse.Finished(
            finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=n)))

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model="fake", max_model_len=1 << 20, block_size=16, vocab_size=32000,
                            tensor_parallel_size=1)

    async def GetServerStats(self, request, context):
        return pb.ServerStats()


async def serve(host: str, port: int, step_s: float) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server(options=ApiSecurity().server_options())  # the real server's limits on pending calls
    pb_grpc.add_GenerationServicer_to_server(FakeGeneration(step_s), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"shardserve ready: fake (tp=1, none) serving on {host}:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--step-ms", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.step_ms / 1000))


if __name__ == "__main__":
    main()
