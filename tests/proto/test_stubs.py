"""The committed gRPC stubs: fresh, importable as shardserve.proto.*, and working over a real loopback server."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from shardserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

PROTO_DIR = Path(generation_pb2.__file__).resolve().parent  # the repo's proto/ in an editable install


def _stub_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if "_pb2" in p.name and p.is_file()}


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    tools = pytest.importorskip("grpc_tools")  # not on the GPU hosts; the dev machines have it
    del tools
    subprocess.run(
        ["bash", str(PROTO_DIR / "generate.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh, committed = _stub_files(tmp_path), _stub_files(PROTO_DIR)
    assert sorted(fresh) == sorted(committed), "stub files missing or left over: run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `make proto`"


def test_every_proto_file_has_committed_stubs():
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert [p.name for p in protos] == ["generation.proto", "worker.proto"]
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (PROTO_DIR / f"{proto.stem}{suffix}").is_file(), f"{proto.stem}{suffix} missing: run `make proto`"


def test_stubs_are_registered_under_the_installed_package_path():
    # The descriptor names are what the generated imports and server reflection resolve.
    assert generation_pb2.DESCRIPTOR.name == "shardserve/proto/generation.proto"
    assert worker_pb2.DESCRIPTOR.name == "shardserve/proto/worker.proto"
    assert generation_pb2.DESCRIPTOR.package == worker_pb2.DESCRIPTOR.package == "shardserve.v1"
    assert generation_pb2_grpc.GenerationStub.__module__ == "shardserve.proto.generation_pb2_grpc"
    assert worker_pb2_grpc.WorkerStub.__module__ == "shardserve.proto.worker_pb2_grpc"


def test_health_and_reflection_packages_import():
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    assert health.HealthServicer and health_pb2.HealthCheckResponse.SERVING and health_pb2_grpc.HealthStub
    assert reflection.SERVICE_NAME == "grpc.reflection.v1alpha.ServerReflection"


def test_optional_sampling_fields_keep_an_explicit_zero_apart_from_unset():
    wire = generation_pb2.GenerateRequest(text="hi", temperature=0.0).SerializeToString()
    parsed = generation_pb2.GenerateRequest.FromString(wire)
    assert parsed.HasField("temperature") and parsed.temperature == 0.0
    assert not parsed.HasField("top_p") and not parsed.HasField("seed") and not parsed.HasField("request_id")
    assert parsed.WhichOneof("prompt") == "text"


class _EchoGeneration(generation_pb2_grpc.GenerationServicer):
    """Streams the prompt's token ids back one delta each: enough to carry every message kind over a socket."""

    def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        yield generation_pb2.GenerateResponse(
            started=generation_pb2.GenerateResponse.Started(request_id=request.request_id, prompt_token_count=len(ids))
        )
        for token_id in ids:
            top = generation_pb2.TopLogprob(token_id=token_id, logprob=-0.25, text=f"<{token_id}>")
            logprob = generation_pb2.TokenLogprob(token_id=token_id, logprob=-0.25, text=top.text, top_logprobs=[top])
            delta = generation_pb2.GenerateResponse.Delta(text=top.text, token_ids=[token_id], logprobs=[logprob])
            yield generation_pb2.GenerateResponse(delta=delta)
        yield generation_pb2.GenerateResponse(
            finished=generation_pb2.GenerateResponse.Finished(
                finish_reason=generation_pb2.FINISH_REASON_LENGTH,
                usage=generation_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(ids)),
                replica="replica-0",
            )
        )

    def Abort(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r}")

    def GetModelInfo(self, request, context):
        return generation_pb2.ModelInfo(model="tiny", vocab_size=32, eos_token_ids=[2], tensor_parallel_size=2)


@pytest.fixture
def generation_channel():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(_EchoGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        channel.close()
        server.stop(grace=None)


def test_generate_stream_round_trips_started_deltas_and_finished(generation_channel):
    stub = generation_pb2_grpc.GenerationStub(generation_channel)
    request = generation_pb2.GenerateRequest(request_id="r1", token_ids=generation_pb2.TokenIds(ids=[5, 7]), logprobs=1)
    responses = list(stub.Generate(request, timeout=10))
    assert [r.WhichOneof("kind") for r in responses] == ["started", "delta", "delta", "finished"]
    assert responses[0].started.request_id == "r1" and responses[0].started.prompt_token_count == 2
    assert [list(r.delta.token_ids) for r in responses[1:3]] == [[5], [7]]
    assert responses[2].delta.text == "<7>" and responses[2].delta.logprobs[0].top_logprobs[0].text == "<7>"
    finished = responses[3].finished
    assert finished.finish_reason == generation_pb2.FINISH_REASON_LENGTH and finished.replica == "replica-0"
    assert (finished.usage.prompt_tokens, finished.usage.completion_tokens) == (2, 2)


def test_unary_calls_carry_messages_and_status_codes(generation_channel):
    stub = generation_pb2_grpc.GenerationStub(generation_channel)
    info = stub.GetModelInfo(generation_pb2.ModelInfoRequest(), timeout=10)
    assert (info.model, info.vocab_size, list(info.eos_token_ids), info.tensor_parallel_size) == ("tiny", 32, [2], 2)
    assert not info.HasField("bos_token_id")
    with pytest.raises(grpc.RpcError) as raised:
        stub.Abort(generation_pb2.AbortRequest(request_id="nope"), timeout=10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as raised:  # not implemented by the servicer: the generated default
        stub.GetServerStats(generation_pb2.ServerStatsRequest(), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED


class _AckingWorker(worker_pb2_grpc.WorkerServicer):
    """Acknowledges each plan of the Step stream with a result naming its step id and requests."""

    def Step(self, request_iterator, context):
        for plan in request_iterator:
            yield worker_pb2.StepResult(step_id=plan.step_id, rank=1, req_ids=plan.req_ids, token_ids=plan.num_tokens)


def test_worker_step_stream_answers_each_plan_in_order():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_WorkerServicer_to_server(_AckingWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            plans = [worker_pb2.StepPlan(step_id=i, req_ids=[f"r{i}"], num_tokens=[i]) for i in range(1, 4)]
            results = list(worker_pb2_grpc.WorkerStub(channel).Step(iter(plans), timeout=10))
    finally:
        server.stop(grace=None)
    assert [(r.step_id, r.rank, list(r.req_ids), list(r.token_ids)) for r in results] == [
        (i, 1, [f"r{i}"], [i]) for i in range(1, 4)
    ]
