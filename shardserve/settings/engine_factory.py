"""The one wiring of an Engine: a resolved EngineConfig and an executor factory -> tokenizer, model facts, Engine.

LLM (with its in-process or local-process executor), the benchmarks (bench/harness.py) and the Ray controller
(`shardserve serve`: EngineFactory, which Ray pickles into the controller actor, where it runs) all build their
engine here, so cluster/ never needs to know how a tokenizer is loaded or where the model's facts come from.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from shardserve.cluster.engine import Engine
from shardserve.settings.resolve import model_facts
from shardserve.proto.config import EngineConfig
from shardserve.cluster.executor import Executor


# transformers' lazy first import is not thread-safe: two replicas loading at once in the controller failed with
# "cannot import name 'AutoTokenizer' from 'transformers'".
_TOKENIZER_LOCK = threading.Lock()


def load_tokenizer(config: EngineConfig):
    """The model's tokenizer from its local folder (never the hub), or None for dummy configs."""
    if config.tokenizer is None:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with _TOKENIZER_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.tokenizer, local_files_only=True)


def build_engine(config: EngineConfig, make_executor: Callable[[EngineConfig], Executor]) -> Engine:
    """Loads the tokenizer and reads the model's facts first (quick, and they fail fast), then makes the executor
    (the workers load their weights and allocate the cache) and the Engine over it."""
    tokenizer = load_tokenizer(config)
    facts = model_facts(config, tokenizer)
    executor = make_executor(config)
    try:
        return Engine(config, executor, tokenizer, facts.eos_token_ids, vocab_size=facts.vocab_size)
    except BaseException:
        executor.shutdown()
        raise


@dataclass
class EngineFactory:
    """build_engine with its executor factory: a picklable callable config -> Engine (ControllerConfig.build_engine)."""

    make_executor: Callable[[EngineConfig], Executor]

    def __call__(self, config: EngineConfig) -> Engine:
        return build_engine(config, self.make_executor)
