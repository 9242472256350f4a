"""The model runner driven by hand-written step plans through InProcessExecutor, checked against transformers.

A tiny random Llama (saved with save_pretrained, loaded by our loader from safetensors) keeps this fast. Random
weights make near-ties in logits, so a token differing from transformers must be a near-tie in transformers' own
logits (< 1e-3) at the first difference; anything else fails.
"""

from __future__ import annotations

import pytest
import torch

from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import NewRequest, SamplingSpec, StepPlan, StepResult, cdiv
from shardserve.worker.inprocess import InProcessExecutor

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 1, 33, 8, 60], [200, 13, 77, 41, 9]]


def save_tiny_llama(folder, **overrides) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**settings)).save_pretrained(folder)
    return str(folder)


def engine_config(model_dir: str, **overrides) -> EngineConfig:
    settings = dict(model=model_dir, block_size=BLOCK_SIZE, num_kv_blocks=64, max_model_len=128,
                    max_num_batched_tokens=256, max_num_seqs=8)
    settings.update(overrides)
    return EngineConfig(**settings)


class PlanDriver:
    """A minimal controller: hands out blocks in order and writes the delta plans proto/plan.py describes."""

    def __init__(self, executor, block_size: int = BLOCK_SIZE) -> None:
        self.executor = executor
        self.block_size = block_size
        self.step_id = 0
        self.next_block = 0
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}

    def add(self, req_id: str, prompt: list[int], sampling: SamplingSpec, cached_from: str | None = None,
            cached_tokens: int = 0, tokens: list[int] | None = None) -> NewRequest:
        """A NewRequest; cached_from shares the first cached_tokens / block_size blocks of another request."""
        shared = self.blocks[cached_from][: cached_tokens // self.block_size] if cached_from else []
        self.tokens[req_id] = list(tokens if tokens is not None else prompt)
        self.prompt_len[req_id] = len(prompt)
        self.computed[req_id] = cached_tokens
        self.blocks[req_id] = list(shared)
        return NewRequest(req_id, list(self.tokens[req_id]), len(prompt), cached_tokens, [], sampling)

    def step(self, schedule: dict[str, int], new: list[NewRequest] = (), finished=(), preempted=()) -> StepResult:
        self.step_id += 1
        new_by_id = {r.req_id: r for r in new}
        plan = StepPlan(self.step_id, new_requests=list(new), finished_req_ids=list(finished),
                        preempted_req_ids=list(preempted))
        for req_id, n in schedule.items():
            needed = cdiv(self.computed[req_id] + n, self.block_size)
            added = []
            while len(self.blocks[req_id]) < needed:
                self.blocks[req_id].append(self.next_block)
                added.append(self.next_block)
                self.next_block += 1
            if req_id in new_by_id:
                new_by_id[req_id].block_ids = list(self.blocks[req_id])
            elif added:
                plan.new_block_ids[req_id] = added
            plan.req_ids.append(req_id)
            plan.num_tokens.append(n)
        result = self.executor.execute(plan)
        for req_id, n in schedule.items():
            self.computed[req_id] += n
        for req_id, token in zip(result.req_ids, result.token_ids):
            self.tokens[req_id].append(token)
        return result

    def prefill_and_decode(self, requests: dict[str, tuple[list[int], SamplingSpec]], num_new: int) -> dict[str, list[int]]:
        new = [self.add(rid, prompt, spec) for rid, (prompt, spec) in requests.items()]
        self.step({rid: len(p) for rid, (p, _) in requests.items()}, new=new)
        for _ in range(num_new - 1):
            self.step({rid: 1 for rid in requests})
        return {rid: self.generated(rid) for rid in requests}

    def generated(self, req_id: str) -> list[int]:
        return self.tokens[req_id][self.prompt_len[req_id] :]


def hf_greedy(model_dir: str, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits it chose them from ([num_new, vocab])."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=num_new, do_sample=False, return_dict_in_generate=True, output_logits=True,
                         pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def assert_same_or_near_tie(ours: list[int], reference: list[int], ref_logits: torch.Tensor) -> None:
    """Our tokens equal transformers', or at the first difference our token is within 1e-3 of transformers' top
    logit there (the prefixes are still equal, so its logits judge); the rest of the path is not compared."""
    if ours == reference:
        return
    assert len(ours) == len(reference), (ours, reference)
    first = next(i for i, (a, b) in enumerate(zip(ours, reference)) if a != b)
    step = ref_logits[first]
    gap = (step.max() - step[ours[first]]).item()
    assert gap < 1e-3, f"token {first} differs ({ours[first]} vs {reference[first]}): our token is {gap} below the top"


GREEDY = SamplingSpec(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return [hf_greedy(model_dir, p, 8) for p in PROMPTS]


@pytest.fixture()
def driver(model_dir):
    executor = InProcessExecutor(engine_config(model_dir))
    yield PlanDriver(executor)
    executor.shutdown()


def test_batched_prefill_then_decodes_match_transformers_greedy(driver, reference):
    out = driver.prefill_and_decode({"a": (PROMPTS[0], GREEDY), "b": (PROMPTS[1], GREEDY)}, 8)
    for rid, (ref_tokens, ref_logits) in zip("ab", reference):
        assert_same_or_near_tie(out[rid], ref_tokens, ref_logits)


def test_chunked_prefill_gives_the_same_tokens(driver, reference):
    new = driver.add("a", PROMPTS[0], GREEDY)
    first = driver.step({"a": 6}, new=[new])
    assert first.req_ids == []  # a prefill chunk that does not reach the end samples nothing
    driver.step({"a": len(PROMPTS[0]) - 6})
    for _ in range(7):
        driver.step({"a": 1})
    assert_same_or_near_tie(driver.generated("a"), *reference[0])


def test_prefix_cache_hit_reuses_blocks_filled_by_an_earlier_request(driver, reference):
    """The hit lands in a block-table row that never held the cached ids (the first request is still running, and
    no block id is 0, the value of a fresh row), so only the runner's own write of the cached ids can make it right."""
    driver.next_block = 3
    driver.prefill_and_decode({"first": (PROMPTS[0], GREEDY)}, 1)
    cached = 2 * BLOCK_SIZE  # the first two full blocks of the shared prompt
    new = driver.add("second", PROMPTS[0], GREEDY, cached_from="first", cached_tokens=cached)
    driver.step({"second": len(PROMPTS[0]) - cached}, new=[new])
    driver.step({"second": 1}, finished=["first"])
    for _ in range(6):
        driver.step({"second": 1})
    assert driver.blocks["second"][:2] == driver.blocks["first"][:2]
    assert_same_or_near_tie(driver.generated("second"), *reference[0])


def test_preempted_request_resumes_with_the_same_tokens(model_dir):
    sampled = SamplingSpec(temperature=1.0, seed=1234)
    specs = {"g": (PROMPTS[0], GREEDY), "s": (PROMPTS[1], sampled)}
    straight = PlanDriver(InProcessExecutor(engine_config(model_dir))).prefill_and_decode(specs, 8)

    driver = PlanDriver(InProcessExecutor(engine_config(model_dir)))
    driver.prefill_and_decode(specs, 3)
    resumed = []
    for rid, (prompt, spec) in specs.items():
        everything = list(driver.tokens[rid])
        del driver.blocks[rid]
        resumed.append(driver.add(rid, prompt, spec, tokens=everything))
    driver.step({rid: len(driver.tokens[rid]) for rid in specs}, new=resumed, preempted=list(specs))
    for _ in range(4):
        driver.step({rid: 1 for rid in specs})
    assert {rid: driver.generated(rid) for rid in specs} == straight


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(model_dir):
    target = SamplingSpec(temperature=0.9, top_p=0.95, seed=77)
    alone = PlanDriver(InProcessExecutor(engine_config(model_dir))).prefill_and_decode({"x": (PROMPTS[0], target)}, 10)
    crowd = {
        "y": (PROMPTS[1], SamplingSpec(temperature=1.0, seed=5)),
        "x": (PROMPTS[0], target),
        "z": (PROMPTS[1][:3], GREEDY),
    }
    together = PlanDriver(InProcessExecutor(engine_config(model_dir))).prefill_and_decode(crowd, 10)
    assert together["x"] == alone["x"]
    assert together["y"] != together["x"]


def test_logprobs_match_transformers_log_softmax(driver, reference):
    spec = SamplingSpec(temperature=0.0, logprobs=3)
    new = [driver.add("a", PROMPTS[0], spec)]
    results = [driver.step({"a": len(PROMPTS[0])}, new=new)] + [driver.step({"a": 1}) for _ in range(3)]
    ref_tokens, ref_logits = reference[0]
    ours = driver.generated("a")
    assert_same_or_near_tie(ours, ref_tokens[:4], ref_logits[:4])
    ref_logp = torch.log_softmax(ref_logits[:4], dim=1)
    for i, res in enumerate(results):  # transformers' logits judge every position up to the first difference
        lp = res.logprobs[0]
        assert abs(lp.logprob - ref_logp[i, ours[i]].item()) < 1e-4
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, ref_logp[i].topk(3).values.tolist())) < 1e-4
        if ours[i] != ref_tokens[i]:
            break  # a near-tie: the top ids may swap, and the paths part from here
        assert lp.top_ids == ref_logp[i].topk(3).indices.tolist()


def test_a_plan_naming_an_unknown_request_is_an_error(driver):
    with pytest.raises(KeyError, match="no state"):
        driver.executor.execute(StepPlan(1, req_ids=["ghost"], num_tokens=[1]))


def test_kv_cache_size_follows_the_config(model_dir):
    from shardserve.worker import kv_cache

    executor = InProcessExecutor(engine_config(model_dir, num_kv_blocks=None, kv_cache_memory_gb=0.0002))
    model = executor.runner.model
    per_block = kv_cache.bytes_per_block(model, BLOCK_SIZE, torch.float32)
    assert per_block == 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # K+V, 2 layers, 2 KV heads, head_dim 16, fp32
    assert executor.num_kv_blocks == int(0.0002 * 2**30) // per_block < 264
    k_cache, v_cache = executor.runner.kv_caches[0]
    assert k_cache.shape == v_cache.shape == (executor.num_kv_blocks, BLOCK_SIZE, 2, 16)
    # a 1 GiB default would be ~65k blocks; max_num_seqs full-length sequences need far fewer
    capped = kv_cache.profile_num_blocks(engine_config(model_dir, num_kv_blocks=None), model, torch.float32,
                                         torch.device("cpu"))
    assert capped == kv_cache.max_useful_blocks(engine_config(model_dir)) == 8 * (128 // BLOCK_SIZE + 1)


def test_a_cpu_kv_cache_larger_than_the_hosts_available_memory_is_refused(model_dir, monkeypatch):
    """The CPU cache takes its pages as it fills (cache_zeros): a size the host cannot hold is refused at sizing,
    from num_kv_blocks and from kv_cache_memory_gb alike, naming both sizes; one that fits is kept."""
    from shardserve.worker import kv_cache

    executor = InProcessExecutor(engine_config(model_dir))
    model, cpu = executor.runner.model, torch.device("cpu")
    per_block = kv_cache.bytes_per_block(model, BLOCK_SIZE, torch.float32)
    monkeypatch.setattr(kv_cache, "_available_host_memory", lambda: 10 * per_block)
    assert kv_cache.profile_num_blocks(engine_config(model_dir, num_kv_blocks=10), model, torch.float32, cpu) == 10
    for settings in (dict(num_kv_blocks=11), dict(num_kv_blocks=None, kv_cache_memory_gb=11.5 * per_block / 2**30)):
        with pytest.raises(ValueError, match=r"\(11 blocks\), more than the .* GiB of memory this host has available"):
            kv_cache.profile_num_blocks(engine_config(model_dir, **settings), model, torch.float32, cpu)
    monkeypatch.undo()
    assert kv_cache._available_host_memory() > 0  # the real one: /proc/meminfo's MemAvailable
