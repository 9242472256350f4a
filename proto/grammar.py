"""What a structured-output spec means: SamplingSpec's (grammar_kind, grammar) -> a grammar compiled for the model's
vocabulary with xgrammar. Both sides agree on it here: the controller compiles at admission (a request whose
grammar does not compile is refused before any step runs, and the compile time is measured there), every worker
compiles the same text for its matchers (worker/grammar_matchers.py). Compiled grammars are cached by their text
in one compiler per (tokenizer folder, vocabulary size) and process, so an in-process engine compiles once.

Why xgrammar (docs/architecture.md has the figures): on the default model's tokenizer a typical schema compiles in
6-36 ms and a cached one is ready in ~0.15 ms; a step's mask fill costs ~3 us a row (a median over a schema's
tokens, 49k and 152k vocabularies alike), against llguidance's 21-34 us with stalls of 8-17 ms where it builds a
lexer state mid-generation.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_BYTES = 65_536  # a schema, regex, choice list or grammar longer than this is refused at admission
MAX_CHOICES = 1_024

_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def grammar_error(exc: Exception) -> str:
    """xgrammar's message without its time stamp and source location."""
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose sentences are exactly the choices (each as a JSON-escaped literal, which xgrammar's EBNF
    reads with the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(slots=True)
class Compiled:
    grammar: Any  # xgrammar.CompiledGrammar
    seconds: float  # this call's time (a cache hit: its look-up)


class GrammarCompiler:
    """One vocabulary's compiler with its cache (by the spec's text). Thread-safe: xgrammar's compiler is."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # one thread: a compile runs beside the engine's own work (2 cores on the development machines)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)

    def compile(self, kind: str, text: str) -> Compiled:
        """Raises ValueError naming the problem (an invalid schema, regex or grammar)."""
        started = time.perf_counter()
        try:
            if kind == "json":
                grammar = self._compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                grammar = self._compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                grammar = self._compiler.compile_regex(text)
            elif kind == "choice":
                grammar = self._compiler.compile_grammar(choice_ebnf(json.loads(text)))
            elif kind == "grammar":
                grammar = self._compiler.compile_grammar(text)
            else:
                raise ValueError(f"unknown structured output kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
        except RuntimeError as e:
            raise ValueError(f"invalid {kind}: {grammar_error(e)}") from None
        return Compiled(grammar, time.perf_counter() - started)


_compilers: dict[tuple[str, int], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def grammar_compiler(tokenizer_dir: str, vocab_size: int, tokenizer: Any = None) -> GrammarCompiler:
    """This process's compiler for a tokenizer folder and vocabulary size (made on first use: ~0.6 s for the
    default model's vocabulary, ~3 s for Qwen's 152k). `tokenizer`: the folder's tokenizer where the caller has it
    loaded already."""
    key = (tokenizer_dir, vocab_size)
    with _compilers_lock:
        compiler = _compilers.get(key)
        if compiler is None:
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            compiler = _compilers[key] = GrammarCompiler(tokenizer, vocab_size)
        return compiler

