"""The offline API: `LLM` (shardserve/api/llm.py), the entry point `from shardserve import LLM` resolves to."""
