"""Session-wide test setup: no hub access, loopback-only Ray, the default model, tiny random models."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub (it reads these once): no test may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Ray binds the machine's external address unless this is set; tests run on 127.0.0.1 only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# dtype="auto" on CPU is bfloat16 where the CPU has AMX or AVX-512 BF16 (shardserve/settings/resolve.py: cpu_auto_dtype), so the suite
# pins it to float32 on every host: the greedy parity with transformers is held in float32, and a test's numbers
# must not depend on which machine CI lands on. Inherited by what a test starts (ranks, serve, Ray's actors).
os.environ.setdefault("SHARDSERVE_CPU_DTYPE", "float32")
# Triton kernels run in its interpreter on CPU-only machines; the mode is read when a kernel module is imported,
# so it is set here, before any test module imports shardserve.kernels.
if not os.path.exists("/dev/nvidia0") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
# Under pytest-xdist (`make test`: two workers by default, on 2-core machines) the cores are always oversubscribed, where
# OpenMP's defaults waste them: a thread that waits at a barrier spins, and a 2-thread parallel region stalls for a
# whole time slice whenever one of its threads is descheduled (a 2.7 s gateway test took 38 s). So each worker's own
# torch keeps to one intra-op thread, and waiting OpenMP threads sleep instead of spinning (PASSIVE). Both are set
# before torch is imported (hf_reference below) and are inherited by what a test starts (worker ranks, serve, the
# session's Ray and its actors); ranks still set their own thread count (worker/distributed.py). Measured on 2 cores,
# test_gateway.py + test_llm_correctness.py on two workers: one thread, spinning: 139 s wall, 263 CPU-seconds; one
# thread, PASSIVE: 116 s, 162; two threads, PASSIVE: 124 s, 183. A plain (serial) pytest run keeps the defaults.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from tests.hf_reference import make_tiny_model  # noqa: E402

# `make test` runs the suite on two pytest-xdist workers (TEST_WORKERS), one test module at a time per worker
# (--dist loadfile --no-loadscope-reorder): modules are handed out in collection order, so the slow ones are
# collected first and the two workers finish close together (longest first), not one worker starting a 90 s module
# while the other idles. Wall seconds of one module alone on 2 cores (2026-12); a module not named here keeps its
# file order after them. Only the order of modules changes: inside a module the file order stays (some tests rely on
# it).
SLOW_MODULES_FIRST = (
    "tests/test_llm_correctness.py",  # 97 s
    "tests/test_mutants.py",  # one pytest subprocess a planted bug
    "tests/test_pipeline_parallel.py",  # 466 s on a loaded host (load average ~30), where the TP tests took 105 s
    "tests/e2e/test_client_resume.py",  # 70 s
    "tests/e2e/test_faults_local.py",  # 69 s
    "tests/e2e/test_serve_signals.py",  # 44 s
    "tests/e2e/test_placement.py",  # 44 s
    "tests/e2e/test_netns_nodes.py",  # 42 s
    "tests/e2e/test_faults_ray.py",  # 39 s
    "tests/e2e/test_serve_cli.py",  # 38 s
    "tests/test_llm_api.py",  # 35 s
    "tests/kernels/test_sampling_filter.py",  # 34 s
    "tests/e2e/test_cluster.py",  # 32 s
    "tests/e2e/test_gateway.py",  # 32 s
    "tests/test_model_cache_race.py",  # 15 s (30 s before the one-parse conversion)
    "tests/bench/test_bench_scaling.py",  # 26 s
    "tests/worker/test_local_workers.py",  # 25 s
    "tests/e2e/test_replica_hosts.py",  # 22 s
    "tests/e2e/test_front_tier.py",  # 65 s (two hosts, two fronts, a controller adopted)
    "tests/bench/test_bench_soak.py",  # 21 s
    "tests/test_kv_fp8_quality.py",  # 19 s
    "tests/bench/test_bench_cpu.py",  # 15 s
    "tests/e2e/test_client.py",  # 14 s
    "tests/bench/test_bench_serve.py",  # 14 s
    "tests/worker/test_cuda_graphs_logic.py",  # 13 s
    "tests/kernels/test_fp8_kv.py",  # 12 s
    "tests/test_cli_errors.py",  # 11 s
    "tests/e2e/test_worker_plane_tls.py",  # 10 s
    "tests/e2e/test_worker_plane_auth.py",  # 10 s
    "tests/e2e/test_workers.py",  # 10 s
    "tests/test_llm_data_parallel.py",  # 9 s
)


def pytest_collection_modifyitems(config, items):
    """Under xdist only: the slow modules first (a stable sort: each module's own order is kept)."""
    if not hasattr(config, "workerinput"):
        return
    rank = {module: i for i, module in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """SmolLM2-135M-Instruct as a local HF folder (converted into the user's cache on first use, ~15 s)."""
    from shardserve.settings.model_source import default_model_dir as convert_or_reuse

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
