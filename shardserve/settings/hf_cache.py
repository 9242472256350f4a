"""Models already in the local Hugging Face cache, found by their hub id ("org/name") from the file system alone:
`LLM(model="Qwen/Qwen3-0.6B")` runs a copy `hf download` (or transformers) left there, and nothing is ever fetched
(shardserve/settings/model_source.py: resolve_model)."""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a model hub id, "org/name"


def hf_hub_cache() -> Path:
    """Where the Hugging Face hub client keeps its downloads (HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hf_cache_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of a model hub id in the HF cache (the one refs/main names, else the newest), read from the
    file system alone: None when there is none with a config.json."""
    repo = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip() / "config.json").is_file():
        return snapshots / ref.read_text().strip()
    found = sorted((d for d in snapshots.glob("*") if (d / "config.json").is_file()), key=lambda d: d.stat().st_mtime)
    return found[-1] if found else None
