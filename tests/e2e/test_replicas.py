"""Replicas behind the global scheduler (cluster/router.py), without Ray: a controller in a thread with three
replicas, each a real gRPC worker server with the tiny Llama, driven through shardserve.client.clients.

Proves: requests sharing a long prefix land on the replica that holds it and hit its prefix cache; unrelated
requests spread over the replicas; the greedy tokens equal one in-process engine's; the replica id is in every
response; a replica whose worker dies stops receiving requests while the others keep serving."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shardserve.client.clients import AsyncClient, Client

NUM_REPLICAS = 3
VOCAB = 384
PREFIX = [(7 * i + 5) % VOCAB for i in range(96)]  # 6 full blocks of 16


def _unrelated(i: int) -> list[int]:
    return [(i * 31 + k * 13 + 1) % VOCAB for k in range(20)]


@pytest.fixture(scope="module")
def served(tiny_llama_dir, e2e_config):
    """(ControllerThread, {endpoint: worker server}) with NUM_REPLICAS replicas, health checked every 0.2 s."""
    from shardserve.cluster.controller import ControllerConfig, ServedModel
    from shardserve.cluster.engine import Engine
    from shardserve.cluster.executor import GrpcExecutor
    from shardserve.worker.worker_service import serve_worker
    from tests.e2e._controller_thread import ControllerThread

    workers: dict[str, object] = {}
    lock = threading.Lock()

    def build(config):
        worker, endpoint = serve_worker("127.0.0.1", 0, secret="test-secret")
        with lock:
            workers[endpoint] = worker
        return Engine(config, GrpcExecutor(config, [endpoint], "tcp://127.0.0.1:0", rpc_timeout_s=2,
                                            secret="test-secret"),
                      vocab_size=VOCAB)

    thread = ControllerThread(ControllerConfig(
        engine=e2e_config(tiny_llama_dir, num_kv_blocks=128), build_engine=build, port=0, name="test",
        model=ServedModel("tiny", "LlamaForCausalLM", vocab_size=VOCAB, eos_token_ids=[]),
        num_replicas=NUM_REPLICAS, health_check_interval_s=0.2,
        restart_tries=0,  # a lost group fails its replica for good here (restarts: tests/e2e/test_faults_*.py)
    ))
    try:
        assert thread.call(thread.controller.wait_ready(180), timeout=200)
        yield thread, workers
    finally:
        thread.close()
        for worker in workers.values():
            worker.stop(grace=None)


def _generate_all(address: str, prompts: list[list[int]], max_tokens: int = 6) -> list:
    async def run():
        async with AsyncClient(address, timeout=120) as client:
            return await asyncio.gather(*(client.generate(p, temperature=0, max_tokens=max_tokens, ignore_eos=True)
                                          for p in prompts))

    return asyncio.run(run())


def _cached_tokens(served, replica_id: str) -> int:
    replica = next(r for r in served.controller.replicas if r.id == replica_id)
    return served.call(replica.stats()).num_cached_prompt_tokens


def _reference(config, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    """One in-process engine (one replica, TP=1): the greedy tokens every replica must give."""
    from shardserve.cluster.engine import Engine
    from shardserve.cluster.sampling_params import SamplingParams
    from shardserve.worker.inprocess import InProcessExecutor
    from tests.engine_driver import drive

    engine = Engine(config, InProcessExecutor(config), vocab_size=VOCAB)
    try:
        for i, p in enumerate(prompts):
            engine.admit(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        drive(engine)
        return [engine.get_output(str(i)).outputs[0].token_ids for i in range(len(prompts))]
    finally:
        engine.shutdown()


def test_requests_sharing_a_long_prefix_land_on_one_replica_and_hit_its_cache(served):
    thread, _ = served
    first = _generate_all(thread.address, [PREFIX + [1, 2, 3]])[0]
    before = _cached_tokens(thread, first.replica)
    followers = _generate_all(thread.address, [PREFIX + [10 + i, 11, 12] for i in range(8)])
    assert {r.replica for r in followers} == {first.replica}
    assert _cached_tokens(thread, first.replica) - before >= 8 * len(PREFIX)  # every follower hit the 6 blocks


def test_unrelated_requests_spread_over_every_replica(served):
    thread, _ = served
    results = _generate_all(thread.address, [_unrelated(i) for i in range(12)])
    counts = {r.id: sum(1 for x in results if x.replica == r.id) for r in thread.controller.replicas}
    assert all(n >= 2 for n in counts.values()), counts
    with Client(thread.address, timeout=30) as client:  # GetServerStats: the sums and each replica's own
        stats = client.server_stats()
    assert [r.id for r in stats.replicas] == list(counts) and {r.state for r in stats.replicas} == {"serving"}
    assert all(r.requests_routed >= counts[r.id] and r.kv_blocks_total == 128 for r in stats.replicas)
    assert sum(r.generation_tokens_total for r in stats.replicas) == stats.generation_tokens_total > 0
    assert sum(r.requests_finished for r in stats.replicas) == stats.requests_finished


def test_outputs_equal_one_replicas_and_name_their_replica(served, tiny_llama_dir, e2e_config):
    thread, _ = served
    prompts = [_unrelated(100 + i) for i in range(6)] + [PREFIX + [40 + i] for i in range(3)]
    results = _generate_all(thread.address, prompts)
    assert [r.token_ids for r in results] == _reference(e2e_config(tiny_llama_dir, num_kv_blocks=128), prompts)
    assert {r.replica for r in results} <= {f"test/{i}" for i in range(NUM_REPLICAS)}


def test_a_stream_interval_sends_the_first_token_alone_then_messages_of_at_least_that_many(served):
    thread, _ = served
    prompt = _unrelated(300)
    with Client(thread.address, timeout=60) as client:
        whole = client.generate(prompt, temperature=0, max_tokens=14, ignore_eos=True).token_ids
        thread.controller.front.stream_interval = 4  # read per stream
        try:
            sizes = [len(d.token_ids) for d in client.stream(prompt, temperature=0, max_tokens=14, ignore_eos=True)
                     if d.token_ids]
        finally:
            thread.controller.front.stream_interval = 1
    assert sum(sizes) == len(whole) == 14 and sizes[0] == 1  # the first token is not held back
    assert all(n >= 4 for n in sizes[1:-1]) and len(sizes) <= 5, sizes  # then >= 4 a message (the last: the rest)


def test_a_replica_whose_worker_dies_stops_receiving_requests(served):
    """Runs last: it kills one replica's worker."""
    thread, workers = served
    victim = thread.controller.replicas[1]
    workers[victim.engine.executor.endpoints[0]].stop(grace=None).wait(30)
    deadline = time.monotonic() + 30
    while thread.controller.status()["replicas"][victim.id] != "failed":  # no request needed to notice
        assert time.monotonic() < deadline, "the replica with a dead worker still counts as serving"
        time.sleep(0.05)
    results = _generate_all(thread.address, [_unrelated(200 + i) for i in range(8)] + [PREFIX + [99]])
    assert all(r.replica != victim.id and len(r.token_ids) == 6 for r in results)
    assert len({r.replica for r in results}) == NUM_REPLICAS - 1  # the others still share the load
    with Client(thread.address, timeout=30) as client:
        assert client.health() == "SERVING"
        failed = client.server_stats().replicas[1]
    assert failed.id == victim.id and failed.state == "failed" and failed.kv_blocks_total == 0


def test_settings_the_workers_refuse_fail_the_start_with_their_message_alone(tiny_llama_dir, e2e_config):
    """A load that fails on settings (ValueError, e.g. caches the host cannot hold) reaches wait_ready as that
    ValueError and its message, which the CLI prints as one line (exit 2); anything else stays a RuntimeError."""
    from shardserve.cluster.controller import ControllerConfig, ServedModel
    from tests.e2e._controller_thread import ControllerThread

    for error, raised in ((ValueError("the KV caches would take 30 GiB"), ValueError),
                          (OSError("disk gone"), RuntimeError)):
        def build(config, error=error):
            raise error

        thread = ControllerThread(ControllerConfig(
            engine=e2e_config(tiny_llama_dir), build_engine=build, port=0, name="refused",
            model=ServedModel("tiny", "LlamaForCausalLM", vocab_size=VOCAB, eos_token_ids=[]), restart_tries=0))
        try:
            with pytest.raises(raised, match=str(error)) as caught:
                thread.call(thread.controller.wait_ready(60), timeout=90)
            assert ("failed to load" in str(caught.value)) is (raised is RuntimeError)
        finally:
            thread.close()
