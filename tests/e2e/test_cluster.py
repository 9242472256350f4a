"""The cluster end to end on a real Ray (loopback) with real gRPC: the default model served with TP=3 by Ray-actor
workers and the controller actor, driven through shardserve.client.clients. It gives the in-process TP=1 engine's greedy
tokens (near-ties aside), survives bad input, aborts and cancels without leaking KV blocks, and shuts down without
leaving an actor, a placement group or a process. A worker failure ends the streams and flips health."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import grpc
import pytest

from shardserve.client.clients import AsyncClient, Client
from shardserve.cluster.step_deadline import StepDeadline
from shardserve.settings.resolve import build_engine_config

NUM_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are"]
MANY = [f"Fact number {i} about the ocean:" for i in range(32)]
ABORTED = "A very long story about a dragon begins"


def _config(model_dir: str, tp: int):
    return build_engine_config(model=model_dir, tensor_parallel_size=tp, device="cpu", num_kv_blocks=128,
                               max_model_len=256, max_num_seqs=64)


def _reference_outputs(model_dir: str) -> dict:
    """The in-process engine at TP=1: greedy tokens and top-5 logprobs (to judge near-ties) for every prompt."""
    from shardserve import LLM, SamplingParams

    llm = LLM(model=model_dir, device="cpu", num_kv_blocks=128, max_model_len=256)
    try:
        prompts = PROMPTS + MANY + [ABORTED]
        lengths = [NUM_TOKENS] * len(PROMPTS) + [8] * len(MANY) + [NUM_TOKENS]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5) for n in lengths]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return dict(zip(prompts, outputs))


@pytest.fixture(scope="module")
def cluster_and_reference(ray_session, default_model_dir):
    """The TP=3 cluster, and the TP=1 reference computed here while the workers load."""
    from concurrent.futures import ThreadPoolExecutor

    from shardserve.launch.ray_serving import start_cluster

    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_reference_outputs, default_model_dir)
        running = start_cluster(_config(default_model_dir, 3), host="127.0.0.1", port=0, metrics_port=0)
        try:
            outputs = reference.result()
        except BaseException:
            running.shutdown(drain_timeout_s=0)
            raise
    yield running, outputs
    running.shutdown(drain_timeout_s=0)


@pytest.fixture(scope="module")
def cluster(cluster_and_reference):
    return cluster_and_reference[0]


@pytest.fixture(scope="module")
def reference(cluster_and_reference):
    return cluster_and_reference[1]


def assert_greedy_matches(ours: list[int], ref, tie_tol: float = 1e-3) -> None:
    """Identical to the reference, or the first difference is a near-tie in the reference's own logprobs; a
    shorter `ours` (an aborted request) is compared as a prefix."""
    for i, (a, b) in enumerate(zip(ours, ref.outputs[0].token_ids)):
        if a != b:
            top = {t: lp.logprob for t, lp in ref.outputs[0].logprobs[i].items()}
            assert a in top and top[b] - top[a] <= tie_tol, (
                f"position {i}: we chose {a}, the reference {b} with top-5 {top}: not a near-tie"
            )
            return


def test_tp3_greedy_tokens_match_in_process_tp1_with_one_request_aborted_midway(cluster, reference):
    async def run():
        async with AsyncClient(cluster.address, timeout=300) as client:
            async def complete(prompt):
                return await client.generate(prompt, temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)

            async def aborted():
                stream = client.stream(ABORTED, request_id="abort-me", temperature=0, max_tokens=200,
                                       ignore_eos=True)
                tokens = []
                async for delta in stream:
                    tokens += delta.token_ids
                    if len(tokens) >= 3 and not aborting:
                        aborting.append(await client.abort("abort-me"))
                return stream.result, tokens

            aborting: list = []
            return await asyncio.gather(*(complete(p) for p in PROMPTS), aborted())

    *results, (aborted_result, aborted_tokens) = asyncio.run(run())
    for prompt, result in zip(PROMPTS, results):
        assert result.finish_reason == "length" and len(result.token_ids) == NUM_TOKENS
        assert result.usage.prompt_tokens == len(reference[prompt].prompt_token_ids)
        assert result.replica == f"{cluster.name}/0"
        assert_greedy_matches(result.token_ids, reference[prompt])
    assert aborted_result.finish_reason == "abort"
    assert 3 <= len(aborted_tokens) < 200 and aborted_result.token_ids == aborted_tokens
    assert_greedy_matches(aborted_tokens, reference[ABORTED])


def test_32_concurrent_streams_match_tp1_and_free_every_block(cluster, reference):
    async def run():
        async with AsyncClient(cluster.address, timeout=300) as client:
            async def one(prompt):
                stream = client.stream(prompt, temperature=0, max_tokens=8, ignore_eos=True)
                deltas = [d async for d in stream]
                return stream.result, deltas

            return await asyncio.gather(*(one(p) for p in MANY))

    for prompt, (result, deltas) in zip(MANY, asyncio.run(run())):
        assert [t for d in deltas for t in d.token_ids] == result.token_ids
        assert "".join(d.text for d in deltas) == result.text
        assert_greedy_matches(result.token_ids, reference[prompt])
    with Client(cluster.address, timeout=60) as client:
        stats = client.server_stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks_total == 128


def test_bad_input_gets_invalid_argument_while_a_concurrent_request_completes(cluster):
    bad_requests = [
        dict(prompt="hello", temperature=-1.0),
        dict(prompt=""),
        dict(prompt="hello", max_tokens=10_000),  # beyond max_model_len
        dict(prompt=[{"role": "wizard", "content": "hi"}]),
        dict(prompt=[1, 2, 10**6]),  # a token id outside the vocabulary
        dict(prompt="hello", request_id="good-one"),  # the live request's id
        dict(prompt="hello", top_p=0.0),
    ]

    async def run():
        async with AsyncClient(cluster.address, timeout=300) as client:
            good = client.stream("The sky is", request_id="good-one", temperature=0, max_tokens=8, ignore_eos=True)
            await good.wait_started()
            codes = []
            for bad in bad_requests:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await client.generate(bad.pop("prompt"), **bad)
                codes.append((error.value.code(), error.value.details()))
            deltas = [d async for d in good]
            return codes, good.result, deltas

    codes, good, deltas = asyncio.run(run())
    assert [c for c, _ in codes] == [grpc.StatusCode.INVALID_ARGUMENT] * len(bad_requests), codes
    details = " | ".join(d for _, d in codes)
    for expected in ("temperature", "empty", "max_model_len", "wizard", "prompt token ids", "already in use", "top_p"):
        assert expected in details
    assert good.finish_reason == "length" and len(good.token_ids) == 8 and deltas


def test_cancelled_stream_frees_its_blocks_and_unknown_abort_is_not_found(cluster):
    with Client(cluster.address, timeout=120) as client:
        stream = client.stream("Tell me everything about", request_id="cancel-me", temperature=0, max_tokens=200,
                               ignore_eos=True)
        next(iter(stream))
        stream.cancel()
        deadline = time.monotonic() + 60
        while (stats := client.server_stats()).num_running or stats.kv_blocks_used:
            assert time.monotonic() < deadline, f"the cancelled request still holds blocks: {stats}"
            time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as error:
            client.abort("cancel-me")
        assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_serving_model_info_reflection_and_metrics(cluster, default_model_dir):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with Client(cluster.address, timeout=30) as client:
        assert client.health() == "SERVING"
        assert client.health("shardserve.v1.Generation") == "SERVING"
        info = client.model_info()
        services = set(ProtoReflectionDescriptorDatabase(client._channel).get_services())
    assert info.tensor_parallel_size == 3 and info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == 49152 and info.has_chat_template and list(info.eos_token_ids) == [2]
    assert {"shardserve.v1.Generation", "grpc.health.v1.Health"} <= services
    text = urllib.request.urlopen(f"http://{cluster.metrics_address}/metrics", timeout=30).read().decode()
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] != "#"}
    model = f'model_name="{info.model}"'
    assert samples['shardserve:requests_total{' + model + ',outcome="length"}'] >= len(PROMPTS)
    assert samples['shardserve:requests_total{' + model + ',outcome="rejected"}'] >= 1
    assert samples["shardserve:generation_tokens_total{" + model + "}"] >= len(PROMPTS) * NUM_TOKENS
    assert samples["shardserve:time_to_first_token_seconds_count{" + model + "}"] >= len(PROMPTS)
    assert samples["shardserve:engine_step_seconds_count{" + model + "}"] > 0
    assert samples["shardserve:kv_cache_blocks_used{" + model + "}"] == 0


def _controller_over_one_worker(engine_config, executor_options: dict, **controller_options):
    """A real worker server and a controller in a thread driving it (no Ray): the tiny model as its ServedModel
    says (no eos). Returns (worker server, ControllerThread)."""
    from shardserve.cluster.controller import ControllerConfig, ServedModel
    from shardserve.cluster.engine import Engine
    from shardserve.cluster.executor import GrpcExecutor
    from shardserve.worker.worker_service import serve_worker
    from tests.e2e._controller_thread import ControllerThread

    worker, endpoint = serve_worker("127.0.0.1", 0, secret="test-secret")

    def build(config):
        return Engine(config, GrpcExecutor(config, [endpoint], "tcp://127.0.0.1:0", secret="test-secret",
                                           **executor_options), vocab_size=384)

    served = ControllerThread(ControllerConfig(
        engine=engine_config,
        model=ServedModel("tiny", "LlamaForCausalLM", vocab_size=384, eos_token_ids=[]),
        build_engine=build,
        port=0,
        **controller_options,
    ))
    return worker, served


def test_a_worker_failure_ends_live_streams_with_unavailable_and_flips_health(tiny_llama_dir, e2e_config):
    """A real worker server that dies under a live request (no Ray needed: the controller in a thread), with group
    restarts off (restart_tries=0; test_faults_local.py has them on)."""
    worker, served = _controller_over_one_worker(e2e_config(tiny_llama_dir), {"deadline": StepDeadline(floor_s=60.0)},
                                                 restart_tries=0)
    try:
        assert served.call(served.controller.wait_ready(120))
        with Client(served.address, timeout=60) as client:
            assert client.generate([1, 2, 3], max_tokens=4).usage.completion_tokens == 4  # healthy first
            worker.stop(grace=None).wait(30)
            with pytest.raises(grpc.RpcError) as error:
                client.generate([1, 2, 3], max_tokens=200, ignore_eos=True, resume=False)  # the server's answer
            # the stream ends with the worker's error, or (when the controller saw the broken stream first) the
            # request is refused with it
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker" in error.value.details() or "rank 0" in error.value.details(), error.value.details()
            assert client.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as error:
                client.generate([1, 2, 3], max_tokens=4)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert served.controller.status()["state"] == "failed"
    finally:
        served.close()
        worker.stop(grace=None)


def test_an_idle_server_notices_a_dead_worker_and_stops_serving(tiny_llama_dir, e2e_config):
    worker, served = _controller_over_one_worker(
        e2e_config(tiny_llama_dir), {"rpc_timeout_s": 2}, health_check_interval_s=0.2, restart_tries=0
    )
    try:
        assert served.call(served.controller.wait_ready(120))
        with Client(served.address, timeout=30) as client:
            assert client.health() == "SERVING"
            worker.stop(grace=None).wait(30)
            deadline = time.monotonic() + 30
            while client.health() != "NOT_SERVING":  # no request needed to notice
                assert time.monotonic() < deadline, "health stayed SERVING with a dead worker"
                time.sleep(0.05)
        assert "rank 0" in served.controller.status()["error"]
    finally:
        served.close()
        worker.stop(grace=None)


def test_shutdown_drains_cuts_off_long_requests_and_leaves_nothing_behind(cluster, ray_session):
    """Runs last: it shuts the module's cluster down."""
    import psutil

    ray = ray_session
    ours = [a for a in ray._private.state.actors().values() if (a["Name"] or "").startswith(cluster.name)]
    pids = [a["Pid"] for a in ours]
    assert len(pids) == 4  # the controller and its 3 ranks
    errors: list = []

    def long_request():
        with Client(cluster.address, timeout=120) as client:
            stream = client.stream("Write a long essay about", temperature=0, max_tokens=200, ignore_eos=True,
                                   resume=False)  # the drain's UNAVAILABLE itself, not a resumed stream
            try:
                for delta in stream:
                    started.set()
            except grpc.RpcError as e:
                errors.append(e.code())

    started = threading.Event()
    thread = threading.Thread(target=long_request)
    thread.start()
    assert started.wait(120)
    assert cluster.shutdown(drain_timeout_s=0.5) == 1  # the long request could not finish in time
    thread.join(60)
    assert errors == [grpc.StatusCode.UNAVAILABLE]
    groups = [g for g in ray.util.placement_group_table().values() if g["name"].startswith(cluster.name)]
    assert groups and all(g["state"] == "REMOVED" for g in groups)
    alive = {a["Name"] for a in ray._private.state.actors().values() if a["State"] != "DEAD"}
    assert not any(name.startswith(cluster.name) for name in alive)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a controller or worker process outlived the shutdown"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
