"""Async scheduling on the real model: the engine overlapping steps on InProcessExecutor (and local worker
processes over gRPC at TP=2) gives exactly the outputs of one step at a time, and the runner feeds sampled tokens
to the next step on the device without reading them back first.

CPU runs the same code path as CUDA (placeholders in the token lists, inputs gathered from the previous step's
token tensor, read-back at finish); only the waiting is not real here.
"""

from __future__ import annotations

import pytest

from shardserve.cluster.engine import Engine
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.cluster.step_deadline import StepDeadline
from shardserve.api.local_executors import create_executor
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import NewRequest, SamplingSpec, StepPlan
from shardserve.worker.inprocess import InProcessExecutor
from shardserve.worker.input_batch import PENDING
from tests.cluster._tiny_tokenizer import byte_level_bpe
from tests.engine_driver import drive

BS = 4
VOCAB = 384  # make_tiny_model's default
EOS = 2
PROMPTS = [[5 + 7 * i + j * (i + 3) % 300 for j in range(3 + (5 * i) % 11)] for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.hf_reference import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-async"), "llama")


def config(model_dir: str, async_on: bool, **overrides) -> EngineConfig:
    settings = dict(model=model_dir, block_size=BS, num_kv_blocks=96, max_model_len=128, max_num_batched_tokens=256,
                    max_num_seqs=8, async_scheduling=async_on)
    settings.update(overrides)
    return EngineConfig(**settings)


def params(i: int) -> SamplingParams:
    """A mix: greedy and seeded, penalties (read back early), logprobs, eos, a stop string, min_tokens."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9, seed=11 + i, top_p=0.9),
        dict(temperature=0.0, repetition_penalty=1.3, logprobs=2),
        dict(temperature=1.0, seed=5, frequency_penalty=0.5, top_k=20),
        dict(temperature=0.0, stop=["e"], min_tokens=2),
        dict(temperature=0.7, seed=99, stop=["a", "o"]),
    ]
    return SamplingParams(max_tokens=5 + 2 * (i % 4), **kinds[i % len(kinds)])


def generate(engine: Engine, abort_after: dict[str, int]) -> dict:
    for i, prompt in enumerate(PROMPTS):
        engine.admit(f"r{i}", prompt, params(i))
    drive(engine, abort_after, max_steps=1000)
    assert engine.block_manager.all_free()
    return {o.request_id: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in engine.take_finished()}


def assert_same_outputs(got: dict, want: dict) -> None:
    """Tokens, text and finish reasons exactly; logprobs to fp32 rounding (a different preemption pattern
    recomputes KV in a prefill instead of decodes, which moves the last bits)."""
    assert {k: v[:3] for k, v in got.items()} == {k: v[:3] for k, v in want.items()}
    for req_id, (*_, logprobs) in got.items():
        expected = want[req_id][3]
        assert (logprobs is None) == (expected is None), req_id
        for a, b in zip(logprobs or (), expected or ()):  # {token id: Logprob}, the sampled token first
            assert list(a) == list(b) and all(a[t].rank == b[t].rank for t in a)
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)


def run_engine(cfg: EngineConfig, executor) -> tuple[dict, Engine]:
    engine = Engine(cfg, executor, byte_level_bpe(), [EOS], vocab_size=VOCAB)
    try:
        return generate(engine, {"r3": 2, "r5": 3}), engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "setting",
    [dict(), dict(num_kv_blocks=8), dict(max_num_batched_tokens=7)],
    ids=["batched", "few-blocks-preemption", "tiny-budget-chunked-prefill"],
)
def test_overlapped_engine_outputs_equal_one_step_at_a_time(model_dir, setting):
    outputs, stats = {}, {}
    for async_on in (False, True):
        cfg = config(model_dir, async_on, **setting)
        outputs[async_on], engine = run_engine(cfg, InProcessExecutor(cfg))
        assert engine.async_scheduling is async_on
        stats[async_on] = engine.stats()
    assert_same_outputs(outputs[True], outputs[False])
    reasons = {o[2] for o in outputs[True].values()}
    assert {"length", "abort"} <= reasons and len(outputs[True]) == len(PROMPTS)
    if "num_kv_blocks" in setting:
        assert stats[True].num_preemptions > 0 and stats[False].num_preemptions > 0


def _plan(step_id: int, **kw) -> StepPlan:
    return StepPlan(step_id=step_id, **kw)


def test_next_step_reads_the_sampled_token_on_the_device_before_it_is_read_back(model_dir):
    sequential = InProcessExecutor(config(model_dir, False))
    overlapped = InProcessExecutor(config(model_dir, True))
    greedy = SamplingSpec(temperature=0.0)
    penalized = SamplingSpec(temperature=0.0, repetition_penalty=1.5)
    new = [NewRequest("g", PROMPTS[0], len(PROMPTS[0]), 0, [0, 1, 2], greedy),
           NewRequest("p", PROMPTS[1], len(PROMPTS[1]), 0, [3, 4, 5], penalized)]
    plans = [
        _plan(1, new_requests=new, req_ids=["g", "p"], num_tokens=[len(PROMPTS[0]), len(PROMPTS[1])]),
        _plan(2, req_ids=["g"], num_tokens=[1]),
        _plan(3, req_ids=["g", "p"], num_tokens=[1, 1]),
        _plan(4, req_ids=["g", "p"], num_tokens=[1, 1]),
        _plan(5, req_ids=["p", "g"], num_tokens=[1, 1]),
    ]
    expected = [sequential.execute(p) for p in plans]

    runner = overlapped.runner
    overlapped.submit(plans[0])  # runner.launch_step: nothing is read back
    g, p = runner.requests["g"], runner.requests["p"]
    assert g.token_ids[-1] == PENDING and p.token_ids[-1] == PENDING  # the sampled values stay on the device
    overlapped.submit(plans[1])  # its input for "g" comes from the first step's token tensor, on the device
    assert g.token_ids[-2:] == [PENDING, PENDING]
    # "p" has a repetition penalty, which reads token values: launching it reads the first step back early.
    overlapped.submit(plans[2])
    assert PENDING not in g.token_ids[:-2] + p.token_ids[:-1]
    assert g.token_ids[-2:] == [PENDING, PENDING]  # the second step's token is still unread
    got = [overlapped.collect(), overlapped.collect(), overlapped.collect()]  # runner.finish_step, oldest first
    for plan in plans[3:]:
        overlapped.submit(plan)
    got += [overlapped.collect(), overlapped.collect()]
    assert [(r.req_ids, r.token_ids) for r in got] == [(r.req_ids, r.token_ids) for r in expected]
    assert PENDING not in g.token_ids + p.token_ids
    sequential.shutdown()
    overlapped.shutdown()


def test_overlapped_tp2_engine_equals_one_step_at_a_time_tp1(model_dir):
    cfg1 = config(model_dir, False, num_kv_blocks=8)
    reference, _ = run_engine(cfg1, InProcessExecutor(cfg1))
    cfg2 = config(model_dir, True, num_kv_blocks=8, tensor_parallel_size=2)
    outputs, engine = run_engine(cfg2, create_executor(cfg2))
    assert engine.async_scheduling
    assert_same_outputs(outputs, reference)


def test_overlapped_engine_over_grpc_equals_one_step_at_a_time(model_dir):
    from shardserve.cluster.executor import GrpcExecutor
    from shardserve.worker.worker_service import serve_worker

    cfg1 = config(model_dir, False)
    reference, _ = run_engine(cfg1, InProcessExecutor(cfg1))
    server, address = serve_worker("127.0.0.1", 0, secret="test-secret")
    try:
        cfg = config(model_dir, True)
        outputs, engine = run_engine(cfg, GrpcExecutor(cfg, [address], "tcp://127.0.0.1:0", deadline=StepDeadline(floor_s=60.0),
                                                 secret="test-secret"))
    finally:
        server.stop(grace=None)
    assert engine.async_scheduling
    assert_same_outputs(outputs, reference)
