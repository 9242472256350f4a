"""Session-wide test setup: no hub access, loopback-only Ray, the default model, tiny random models."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub (it reads these once): no test may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Ray binds the machine's external address unless this is set; tests run on 127.0.0.1 only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Triton kernels run in its interpreter on CPU-only machines; the mode is read when a kernel module is imported,
# so it is set here, before any test module imports shardserve.kernels.
if not os.path.exists("/dev/nvidia0") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tests.hf_reference import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """SmolLM2-135M-Instruct as a local HF folder (converted into the user's cache on first use, ~20 s)."""
    from shardserve.models import default_model_dir as convert_or_reuse

    return convert_or_reuse()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: tiny_model(arch="llama"|"qwen2"|"qwen3", **make_tiny_model options) -> folder.

    The same options return the same folder for the whole session (saving once).
    """
    made: dict[tuple, str] = {}

    def make(arch: str = "llama", **options) -> str:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **options)
        return made[key]

    return make
