"""Our Llama/Qwen2/Qwen3 against transformers on tiny random configs (CPU, fp32), through the paged cache.

Proves: whole-prompt logits equal HF's; the paged paths (chunked prefill over a cached prefix, single-token
decodes, a batch mixing a decode with a prefill chunk) give the same logits as the whole prompt; TP 2 over
gloo (incl. replicated KV heads and a vocabulary not divisible by TP) equals HF; bad configs fail clearly.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2
from transformers import Qwen3ForCausalLM as HFQwen3

from shardserve.kernels.backends import AttentionMetadata
from shardserve.kernels.torch_backend import TorchAttentionBackend
from shardserve.proto.transport import free_port
from shardserve.worker import distributed
from shardserve.worker.loader import load_weights
from shardserve.worker.models.registry import build_model

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16, max_position_embeddings=256)
CONFIGS = {
    "llama-tied-gqa": (HFLlama, lambda: LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                                                    vocab_size=256, tie_word_embeddings=True, rope_theta=1e5)),
    "llama3-untied-scaled-rope": (HFLlama, lambda: LlamaConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, vocab_size=255, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2-qkv-bias": (HFQwen2, lambda: Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                                                    vocab_size=256, tie_word_embeddings=False)),
    "qwen3-qk-norm-one-kv-head": (HFQwen3, lambda: Qwen3Config(**_COMMON, num_attention_heads=4, num_key_value_heads=1,
                                                               vocab_size=256, tie_word_embeddings=True)),
}


def save_hf_model(name: str, folder) -> torch.nn.Module:
    hf_class, make_config = CONFIGS[name]
    torch.manual_seed(1234)
    config = make_config()
    config.architectures = [hf_class.__name__]
    hf = hf_class(config).eval()
    with torch.no_grad():  # biases and norms are 0 / 1 at init: make them matter
        for pname, p in hf.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


class PagedRunner:
    """A minimal stand-in for the model runner: sequences with scattered blocks, steps of (seq, new tokens)."""

    def __init__(self, model: torch.nn.Module, seed: int = 0) -> None:
        self.model = model
        shape = (NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads_per_rank, model.head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous block tables
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Runs one step; returns each chunk's logits [len(tokens), vocab]."""
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            self.lengths[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in chunks)
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _ in chunks]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


def load_ours(folder, hf_config) -> torch.nn.Module:
    model = build_model(hf_config, torch.float32, torch.device("cpu"), TorchAttentionBackend())
    load_weights(model, str(folder))
    return model


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=sorted(CONFIGS))
def models(request, tmp_path):
    distributed.init_distributed(0, 1, "", "gloo", 10.0)
    hf = save_hf_model(request.param, tmp_path)
    return hf, load_ours(tmp_path, hf.config)


def test_whole_prompt_logits_match_transformers(models):
    hf, ours = models
    tokens = prompt(23, ours.vocab_size, seed=1)
    (logits,) = PagedRunner(ours).step([("a", tokens)])
    assert logits.shape == (23, ours.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decodes_match_whole_prompt(models):
    hf, ours = models
    tokens = prompt(19, ours.vocab_size, seed=2)
    expected = hf_logits(hf, tokens)
    runner = PagedRunner(ours, seed=1)
    prefix, rest = runner.step([("a", tokens[:6])])[0], runner.step([("a", tokens[6:])])[0]
    torch.testing.assert_close(torch.cat([prefix, rest]), expected, atol=ATOL, rtol=0)

    runner = PagedRunner(ours, seed=2)
    outs = runner.step([("b", tokens[:9])])
    for t in tokens[9:]:
        outs += runner.step([("b", [t])])
    torch.testing.assert_close(torch.cat(outs), expected, atol=ATOL, rtol=0)


def test_mixed_batch_equals_separate_runs(models):
    hf, ours = models
    a, b, c = (prompt(n, ours.vocab_size, seed=s) for n, s in ((10, 3), (14, 4), (7, 5)))
    runner = PagedRunner(ours, seed=3)
    runner.step([("a", a), ("c", c)])
    # one step: a decode of a, the first chunk of b, a decode of c (decodes not contiguous in the batch)
    mixed = runner.step([("a", [5]), ("b", b[:8]), ("c", [9])])
    torch.testing.assert_close(mixed[0][-1], hf_logits(hf, a + [5])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1], hf_logits(hf, b[:8]), atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[2][-1], hf_logits(hf, c + [9])[-1], atol=ATOL, rtol=0)


def test_unsupported_architecture_names_the_supported_ones():
    distributed.init_distributed(0, 1, "", "gloo", 10.0)
    config = LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        build_model(config, torch.float32, torch.device("cpu"), TorchAttentionBackend())


def test_tp_not_dividing_heads_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(distributed, "_group", distributed._TPGroup(rank=0, size=3))
    config = LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="tensor_parallel_size \\(3\\) must divide num_attention_heads \\(4\\)"):
        build_model(config, torch.float32, torch.device("cpu"), TorchAttentionBackend())


def _tp_worker(rank: int, world_size: int, port: int, folders: dict[str, str], failures) -> None:
    torch.set_num_threads(1)
    distributed.init_distributed(rank, world_size, f"tcp://127.0.0.1:{port}", "gloo", 60.0)
    try:
        for name, folder in folders.items():
            hf_class, _ = CONFIGS[name]
            hf = hf_class.from_pretrained(folder).eval()
            ours = load_ours(folder, hf.config)
            assert ours.num_kv_heads_per_rank == max(1, hf.config.num_key_value_heads // world_size)
            tokens = prompt(13, ours.vocab_size, seed=6)
            runner = PagedRunner(ours)
            logits = torch.cat(runner.step([("a", tokens[:7])]) + runner.step([("a", tokens[7:])]))
            if rank == 0:
                diff = (logits - hf_logits(hf, tokens)).abs().max().item()
                if not diff <= ATOL:
                    failures.put(f"{name} at TP {world_size}: max |diff| {diff}")
    finally:
        distributed.destroy_distributed(10.0)


def test_tensor_parallel_2_over_gloo_matches_transformers(tmp_path):
    # llama3-untied: vocab 255 (padded last shard); qwen3: 1 KV head replicated on both ranks
    names = ["llama3-untied-scaled-rope", "qwen2-qkv-bias", "qwen3-qk-norm-one-kv-head"]
    folders = {}
    for name in names:
        folders[name] = str(tmp_path / name)
        save_hf_model(name, folders[name])
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_tp_worker, args=(2, free_port(), folders, failures), nprocs=2, join=True)
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not errors, errors
