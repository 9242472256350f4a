"""The server's prompts are tokenized on the PromptEncoder's threads (each with its own tokenizer copy), never on
the caller's, and text over the byte limit is refused before any tokenizing, naming the limit."""

from __future__ import annotations

import asyncio
import threading

import pytest

from shardserve.cluster.admission import prompt_text_bytes
from shardserve.cluster.prompt_encoder import PromptEncoder, default_max_prompt_bytes


class RecordingTokenizer:
    """One token per UTF-8 byte; records the thread and the instance of every encode."""

    chat_template = "x"
    calls: list[tuple[str, int]] = []

    def encode(self, text, add_special_tokens=True):
        RecordingTokenizer.calls.append((threading.current_thread().name, id(self)))
        return list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(m["content"] for m in messages)


def test_prompts_are_tokenized_on_the_pool_with_a_copy_of_the_tokenizer():
    tokenizer = RecordingTokenizer()
    RecordingTokenizer.calls = []
    encoder = PromptEncoder(tokenizer, max_prompt_bytes=1024)

    async def run():
        return await asyncio.gather(encoder.encode("héllo"), encoder.encode([3, 4]),
                                    encoder.encode([{"role": "user", "content": "hi"}]))

    try:
        assert asyncio.run(run()) == [("héllo", list("héllo".encode())), (None, [3, 4]), ("hi", [104, 105])]
    finally:
        encoder.close()
    assert RecordingTokenizer.calls
    assert all(name.startswith("shardserve-tokenize") for name, _ in RecordingTokenizer.calls)
    assert all(instance != id(tokenizer) for _, instance in RecordingTokenizer.calls)  # never the engine's own


@pytest.mark.parametrize("prompt", ["é" * 600, [{"role": "user", "content": "a" * 700}, {"role": "user", "content": "b" * 400}],
                                    {"prompt": "z" * 1025}])
def test_text_over_the_byte_limit_is_refused_before_tokenizing(prompt):
    RecordingTokenizer.calls = []
    encoder = PromptEncoder(RecordingTokenizer(), max_prompt_bytes=1024)
    try:
        with pytest.raises(ValueError, match=r"over this server's limit of 1024 bytes \(--max-prompt-bytes\)"):
            asyncio.run(encoder.encode(prompt))
    finally:
        encoder.close()
    assert RecordingTokenizer.calls == []


def test_prompt_bytes_count_utf8_and_the_default_limit_scales_with_max_model_len():
    assert prompt_text_bytes("é") == 2 and prompt_text_bytes([1, 2, 3]) == 0
    assert prompt_text_bytes([{"role": "user", "content": "ab"}, {"role": "system", "content": "€"}]) == 5
    assert default_max_prompt_bytes(256) == 64 * 1024 and default_max_prompt_bytes(32768) == 32 * 32768
