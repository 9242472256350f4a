"""e2e setup: one real Ray on loopback for the whole test session, and tiny random models.

Ray starts once (4-5 s, ~1 GiB): every e2e test that needs it takes `ray_session`. Tests that need a multi-raylet
cluster (ray.cluster_utils.Cluster) run it in a subprocess of their own, since this process is already connected.
"""

from __future__ import annotations

import os

# Before ray is imported or initialised: without it Ray binds the machine's external address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import pytest  # noqa: E402

from shardserve.proto.config import EngineConfig  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """The session's Ray (8 logical CPUs on loopback, no dashboard); shut down at the end of the session. Under
    pytest-xdist each worker process has a Ray of its own."""
    import ray

    from shardserve.launch.local_ray import init_local_ray

    started_here = not ray.is_initialized()
    if started_here:
        # Always a new Ray of this process's own, never one found through RAY_ADDRESS or /tmp/ray/ray_current_cluster
        # (which test_placement.py's simulated cluster writes while it runs, maybe in another pytest-xdist worker);
        # started again once when its raylet does not register in time (that start's logs in a warning).
        init_local_ray(8, log_to_driver=False, namespace="shardserve-tests")
    yield ray
    if started_here:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model) -> str:
    """A tiny random Llama with 4 heads and 2 KV heads: TP=2 divides both."""
    return tiny_model("llama", num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="session")
def e2e_config():
    """Factory: a small-cache CPU EngineConfig for a model folder (fast to profile and allocate)."""

    def make(model_dir: str, **overrides) -> EngineConfig:
        settings = dict(
            model=model_dir,
            device="cpu",
            dtype="float32",
            block_size=16,
            num_kv_blocks=64,
            max_model_len=256,
            max_num_batched_tokens=256,
            max_num_seqs=16,
            dist_timeout_s=30.0,
        )
        settings.update(overrides)
        return EngineConfig(**settings)

    return make
