"""shardserve: a distributed tensor-parallel LLM inference cluster."""
