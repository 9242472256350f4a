"""The `shardserve` command (main.py): generate | serve | client | gateway | bench, with flags derived from the
config dataclasses (flags.py)."""
