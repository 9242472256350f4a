"""The device block table (worker/block_tables.py) through InputBatch: over random plan sequences (new requests,
appended blocks, finished and preempted requests whose rows are reused, chunked prefills), every step's gathered
tables equal each scheduled request's own block ids, and a step's host list holds no block ids at all."""

from __future__ import annotations

import random

import pytest
import torch

from shardserve.proto.plan import NewRequest, SamplingSpec, StepPlan, cdiv
from shardserve.worker.block_tables import DeviceBlockTables
from shardserve.worker.input_batch import InputBatch

BLOCK = 4


class PlanMaker:
    """A toy scheduler: the blocks it hands out, the requests it runs, one plan per step (no sampled tokens: each
    scheduled token is known, as after a prefill chunk or a read-back decode)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.free = list(range(4096))
        rng.shuffle(self.free)  # scattered, as after preemption and prefix hits
        self.running: dict[str, list] = {}  # req id -> [tokens, computed, block ids]
        self.step = 0
        self.next_id = 0

    def plan(self) -> StepPlan:
        self.step += 1
        rng, finished, preempted, new, new_blocks, req_ids, counts = self.rng, [], [], [], {}, [], []
        for req_id in list(self.running):
            roll = rng.random()
            if roll < 0.1:
                (finished if roll < 0.06 else preempted).append(req_id)
                self.free += self.running.pop(req_id)[2]
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            req_id, self.next_id = f"r{self.next_id}", self.next_id + 1
            tokens = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
            computed = rng.choice([0, len(tokens) - 1])  # a cold prompt, or a prefix hit up to its last token
            n = len(tokens) - computed
            blocks = [self.free.pop() for _ in range(cdiv(len(tokens), BLOCK))]
            self.running[req_id] = [tokens, computed, blocks]
            new.append(NewRequest(req_id, list(tokens), len(tokens), computed, list(blocks), SamplingSpec()))
        for req_id, (tokens, computed, blocks) in self.running.items():
            if computed == len(tokens):  # decode: one more known token, maybe a new block
                tokens.append(rng.randrange(1000))
            n = min(len(tokens) - computed, rng.choice([1, 3, 64]))
            extra = cdiv(computed + n, BLOCK) - len(blocks)
            if extra > 0:
                got = [self.free.pop() for _ in range(extra)]
                blocks += got
                if all(r.req_id != req_id for r in new):
                    new_blocks[req_id] = got
            req_ids.append(req_id)
            counts.append(n)
            self.running[req_id][1] = computed + n
        return StepPlan(self.step, new_requests=new, req_ids=req_ids, num_tokens=counts,
                        finished_req_ids=finished, preempted_req_ids=preempted, new_block_ids=new_blocks)


@pytest.mark.parametrize("seed", range(4))
def test_every_step_reads_each_requests_own_blocks(seed):
    maker = PlanMaker(random.Random(seed))
    batch = InputBatch(BLOCK, max_seqs=2, max_blocks=1)  # tiny: rows and columns grow mid-run
    for _ in range(120):
        plan = maker.plan()
        for r in plan.new_requests:  # the toy scheduler appends decode tokens before the worker sees them
            r.token_ids = list(maker.running[r.req_id][0])
        for req_id in plan.req_ids:
            if req_id in batch.requests:
                batch.requests[req_id].token_ids = list(maker.running[req_id][0])
        step = batch.prepare(plan)
        if not step.states:
            continue
        _, _, meta = step.to_device(torch.device("cpu"))
        for row, (req_id, end) in enumerate(zip(plan.req_ids, step.seq_lens)):
            want = maker.running[req_id][2][: cdiv(end, BLOCK)]
            assert meta.block_tables[row, : len(want)].tolist() == want, (plan.step_id, req_id)
        rows = {s.table_row for s in batch.requests.values()}
        assert len(rows) == len(batch.requests)  # no two live requests share a row


def test_a_decode_steps_host_list_does_not_grow_with_the_context():
    """Eight decodes over 40 and over 1,600 tokens of context: the same host list (ids, positions, context lengths,
    table rows, query starts); the blocks went to the device when the requests arrived."""
    lengths = []
    for context in (40, 1600):
        batch = InputBatch(BLOCK)
        new = [NewRequest(str(i), [1] * context, context, context - 1, list(range(i * 400, i * 400 + context // 4)),
                          SamplingSpec()) for i in range(8)]
        step = batch.prepare(StepPlan(1, new_requests=new, req_ids=[r.req_id for r in new], num_tokens=[1] * 8))
        _, _, meta = step.to_device(torch.device("cpu"))
        assert meta.block_tables.tolist() == [r.block_ids for r in new]
        lengths.append(len(step.flat))
    assert lengths == [8 + 8 + 8 + 8 + 9] * 2


def test_rows_are_reused_and_the_table_grows_keeping_what_it_held():
    tables = DeviceBlockTables(rows=1, cols=2)
    a, b = tables.assign(), tables.assign()
    tables.write(a, 0, [5, 6])
    tables.write(b, 0, [7])
    tables.flush(torch.device("cpu"))
    tables.write(a, 2, [8, 9, 10])  # past the columns
    c = tables.assign()
    tables.write(c, 0, [11])  # past the rows
    table = tables.flush(torch.device("cpu"))
    assert table.shape[0] >= 3 and table.shape[1] >= 5
    rows = tables.gather(torch.tensor([c, a, b]), 5).tolist()
    assert rows[0][0] == 11 and rows[1] == [5, 6, 8, 9, 10] and rows[2][0] == 7
    tables.release(a)
    assert tables.assign() == a  # a freed row is the next one taken
