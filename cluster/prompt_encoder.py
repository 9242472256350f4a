"""PromptEncoder: the server's prompts are tokenized on a small thread pool, never on the engine's thread (where a
multi-megabyte prompt would stall every running stream for seconds) nor on the event loop, after a byte limit
checked before any tokenizing (a prompt of 4 MB is refused in microseconds, not after 3 s of BPE).

Each pool thread tokenizes with its own copy of the tokenizer: the engine thread keeps its own (detokenizing), and
a fast tokenizer's settings are not safe to share across threads. The Rust tokenizer releases the GIL for the
bulk of the work, so the engine thread keeps stepping meanwhile (docs/performance-history.md has the measured gaps).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardserve.cluster.admission import Prompt, encode_prompt, prompt_text_bytes
from shardserve.cluster.structured_outputs import compile_at_admission

BYTES_PER_TOKEN_LIMIT = 32  # the default limit: 32 bytes of text per token of max_model_len (a token is ~4)


def default_max_prompt_bytes(max_model_len: int) -> int:
    return max(64 * 1024, BYTES_PER_TOKEN_LIMIT * max_model_len)


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_prompt_bytes: int, threads: int = 2,
                 grammar_vocab: tuple[str | None, int] | None = None) -> None:
        """grammar_vocab: (tokenizer folder, vocabulary size) that structured outputs compile for."""
        self.max_prompt_bytes = max_prompt_bytes
        self._tokenizer = tokenizer
        self._grammar_vocab = grammar_vocab
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="shardserve-tokenize")

    async def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids), as admission.encode_prompt; ValueError for a prompt over the byte limit
        (before tokenizing) or one the model cannot take."""
        size = prompt_text_bytes(prompt)
        if size > self.max_prompt_bytes:
            raise ValueError(f"the prompt's text is {size} bytes, over this server's limit of "
                             f"{self.max_prompt_bytes} bytes (--max-prompt-bytes)")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, prompt)

    async def echo_texts(self, text: str | None, token_ids: list[int]) -> tuple[str, str]:
        """(the prompt as text: `text` where the prompt came as text, else its token ids decoded; its first token
        alone, decoded), on the pool; "" for what no tokenizer can decode."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._echo_texts, text, token_ids)

    async def compile_grammar(self, params: Any) -> float:
        """Compiles a request's structured-output grammar on the pool (ValueError if it cannot compile), so that
        the engine thread's admission finds it in the cache; returns the seconds the compile took."""
        if self._grammar_vocab is None:
            raise ValueError("structured_outputs is not available on this server")
        tokenizer_dir, vocab_size = self._grammar_vocab
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, compile_at_admission, params, tokenizer_dir, vocab_size, self._tokenizer)

    def _thread_tokenizer(self):
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None and self._tokenizer is not None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return tokenizer

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return encode_prompt(prompt, self._thread_tokenizer())

    def _echo_texts(self, text: str | None, token_ids: list[int]) -> tuple[str, str]:
        tokenizer = self._thread_tokenizer()
        if tokenizer is None or not token_ids:
            return text or "", ""
        return text if text is not None else tokenizer.decode(token_ids), tokenizer.decode(token_ids[:1])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
