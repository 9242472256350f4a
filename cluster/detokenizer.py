"""Incremental detokenization and stop strings.

Decoding the whole output after every token costs O(tokens) per step; instead each new token decodes a small
window (the prefix/read offset approach): `prefix` marks where the last emitted window started, `read` where the
already-emitted text ends. The new text is decode(ids[prefix:]) minus decode(ids[prefix:read]). A token that
ends in the middle of a multi-byte character decodes to U+FFFD; then nothing is emitted until the character
completes. The window starts a few prompt tokens back so that tokenizers which drop a leading space when
decoding a sequence's first token (SentencePiece) still produce the right first characters.

Stop strings are searched only in the newly decoded area (plus the longest stop string's length before it). The
text is truncated before the first match, so a stop string never appears in the output (unless include_stop_str
keeps it, as vLLM's include_stop_str_in_output); while streaming, the last
len(longest stop) - 1 characters are held back because they might still turn into a stop string.

Tokens that a decode with skip_special_tokens leaves out are not put in the window at all (the same text): kept,
a run of them would grow the window, and the cost of every decode with it, until a token adds text again.

Each token costs two decodes, on the engine's thread, for every request of every step. A transformers fast
tokenizer's decode is its Rust tokenizer's decode plus Python around it (and an optional space cleanup); where
that cleanup is off the Rust decode is called directly: the same text, ~3x less host time a call
(`backend_decode`).
"""

from __future__ import annotations

import functools
from typing import Any

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, for the first tokens' spacing
REPLACEMENT_CHAR = "\ufffd"


def backend_decode(tokenizer: Any):
    """The decode function to call: a transformers fast tokenizer's own Rust tokenizer (tokenizers.Tokenizer)
    where transformers would return its text unchanged (no clean_up_tokenization_spaces), else the tokenizer's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode
    return tokenizer.decode


def skipped_ids(tokenizer: Any) -> frozenset[int]:
    """The ids decode(..., skip_special_tokens=True) leaves out: the special added tokens of the Rust tokenizer (a
    tokenizers.Tokenizer, or a transformers fast tokenizer's own), else transformers' all_special_ids. Computed
    once per tokenizer (each request makes a detokenizer), except for a tokenizer that cannot be hashed."""
    try:
        return _skipped_ids_once(tokenizer)
    except TypeError:  # unhashable
        return _skipped_ids(tokenizer)


@functools.lru_cache(maxsize=16)
def _skipped_ids_once(tokenizer: Any) -> frozenset[int]:
    return _skipped_ids(tokenizer)


def _skipped_ids(tokenizer: Any) -> frozenset[int]:
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "get_added_tokens_decoder"):
        return frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ) -> None:
        self.tokenizer = tokenizer  # anything with decode(ids, skip_special_tokens=...): transformers or tokenizers
        self._decode_ids = backend_decode(tokenizer)
        self._skipped = skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str = include_stop_str  # keep a matched stop string at the end of the text
        self.stop = list(stop or [])
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""  # the output text so far (truncated before a stop string once one matched)
        self.num_emitted_chars = 0  # text[:n] already handed out as deltas
        self.stopped_by: str | None = None  # the stop string that matched

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> bool:
        """Decodes one generated token. Returns True when the text now contains a stop string (then `text`
        ends right before it, or right after it with include_stop_str, and later tokens must not be added).
        check_stop=False (min_tokens not reached yet) only decodes."""
        if token_id in self._skipped:
            return False
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return False  # nothing printable yet (special token skipped, or a character still incomplete)
        return self._append_text(new_text[len(prefix_text) :], check_stop)

    def flush(self) -> None:
        """At the end: emit whatever is still held in the window, even an incomplete character."""
        if self.stopped_by is not None or self._read == len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text):
            self._append_text(new_text[len(prefix_text) :], check_stop=False)

    def _append_text(self, delta: str, check_stop: bool) -> bool:
        self._prefix, self._read = self._read, len(self._ids)
        start = len(self.text)
        self.text += delta
        if not self.stop or not check_stop:
            return False
        search_from = max(start - self.hold_back, 0)
        best = -1
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best == -1 or idx < best):
                best, self.stopped_by = idx, s
        if best == -1:
            return False
        self.text = self.text[: best + (len(self.stopped_by) if self.include_stop_str else 0)]
        return True

    def take_delta(self, final: bool) -> str:
        """Text not handed out yet that is safe to show: all of it when final, else all but the held-back tail."""
        end = len(self.text) if final or self.stopped_by is not None else len(self.text) - self.hold_back
        if end <= self.num_emitted_chars:
            return ""
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
