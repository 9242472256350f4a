"""Two first runs at once: the default model's conversion into an empty cache is safe when processes race.

Kept apart from test_models.py: it converts the GGUF file twice in parallel (~15 s on 2 idle cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

CONVERT_IN_CHILD = "from shardserve.settings.model_source import default_model_dir; print(default_model_dir())"


@pytest.mark.slow
def test_two_concurrent_first_conversions_both_succeed_with_one_folder(tmp_path):
    """Two processes convert into a fresh cache at once: both get the same complete folder, no leftovers."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1")
    children = [
        subprocess.Popen([sys.executable, "-c", CONVERT_IN_CHILD], cwd=REPO_ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    outputs = []
    for child in children:
        try:
            stdout, stderr = child.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            child.kill()
            stdout, stderr = child.communicate()
        outputs.append((child.returncode, stdout.strip(), stderr))
    for returncode, stdout, stderr in outputs:
        assert returncode == 0, stderr[-2000:]
    folders = {stdout.splitlines()[-1] for _, stdout, _ in outputs}
    assert len(folders) == 1
    cache = tmp_path / "shardserve" / "models"
    assert [p.name for p in cache.iterdir()] == [Path(folders.pop()).name]  # the losers' copies are gone
    assert any("converting" in stderr and "once" in stderr for _, _, stderr in outputs)
    converted = next(cache.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in converted.iterdir()}
