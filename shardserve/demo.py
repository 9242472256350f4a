"""`make demo`: the whole cluster on this machine. A local Ray on loopback, the default model served with
tensor parallelism 3 on CPU (SmolLM2-135M: 9 heads, 3 KV heads, so each rank holds 3 heads and 1 KV head),
prompts sent through the gRPC client with their text streamed as it comes, then a clean shutdown.

It also measures its own memory: the summed PSS (shared pages counted once) of every process it started, Ray's
included, sampled throughout the run.
"""

from __future__ import annotations

import os
import sys
import threading
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
]
BATCH = [f"Give one fun fact about the number {n}." for n in range(4)]


class PssSampler:
    """Peak summed PSS of this process and all its descendants (Ray's GCS, raylet and workers start under it)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        import psutil

        self._root = psutil.Process()
        self.peak_bytes = 0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        import psutil

        total, count = 0, 0
        for proc in [self._root, *self._root.children(recursive=True)]:
            try:
                total += proc.memory_full_info().pss
                count += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_processes = total, count
        return total

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()

    def __enter__(self) -> "PssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _leftover_processes(deadline_s: float = 30.0) -> list[str]:
    """This process's descendants still alive after shutdown (polled until none or the deadline)."""
    import psutil

    deadline = time.monotonic() + deadline_s
    while True:
        alive = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return [f"{p.pid} {p.name()}" for p in alive]
        time.sleep(0.2)


def _leftover_ray_objects() -> list[str]:
    """Actors not dead and placement groups not removed (asked of Ray's GCS, no dashboard needed)."""
    import ray

    actors = [f"actor {a['Name'] or a['ActorID']}" for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
    groups = [f"placement group {pg_id}" for pg_id, pg in ray.util.placement_group_table().items()
              if pg["state"] != "REMOVED"]
    return actors + groups


def main() -> int:
    # Loopback only: without this Ray binds the machine's external address.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from shardserve.client.clients import Client
    from shardserve.settings.resolve import build_engine_config
    from shardserve.launch.placement import ensure_ray
    from shardserve.launch.ray_serving import start_cluster

    start = time.perf_counter()
    config = build_engine_config(tensor_parallel_size=3, device="cpu", num_kv_blocks=512)  # converts once
    with PssSampler() as memory:
        ensure_ray("local")
        print(f"[ray started on loopback in {time.perf_counter() - start:.1f} s; launching 3 workers]", flush=True)
        cluster = start_cluster(config, host="127.0.0.1", port=0)
        try:
            ready_s = time.perf_counter() - start
            with Client(cluster.address, timeout=300) as client:
                info = client.model_info()
                print(f"[serving {info.model} ({info.architecture}) in {info.dtype} with tp={info.tensor_parallel_size} on "
                      f"{cluster.address}, ready in {ready_s:.1f} s]\n", flush=True)
                for prompt in PROMPTS:
                    print(f"> {prompt}")
                    stream = client.stream(_chat(prompt), temperature=0, max_tokens=48)
                    for delta in stream:
                        sys.stdout.write(delta.text)
                        sys.stdout.flush()
                    print(f"\n  [{stream.result.finish_reason}, {stream.result.usage.completion_tokens} tokens, "
                          f"served by {stream.result.replica}]\n")
                print(f"[and {len(BATCH)} chats at once, batched together by the controller:]")
                with ThreadPoolExecutor(len(BATCH)) as pool:
                    results = list(pool.map(lambda p: client.chat(_chat(p), temperature=0, max_tokens=32), BATCH))
                for prompt, result in zip(BATCH, results):
                    print(f"> {prompt}\n{result.text.strip()}\n")
                stats = client.server_stats()
                print(f"[server: {stats.requests_finished} requests, {stats.generation_tokens_total} tokens "
                      f"generated, {stats.kv_blocks_used} KV blocks in use]")
            memory.sample()
        finally:
            cluster.shutdown(drain_timeout_s=10)
            leftovers = _leftover_ray_objects()
            ray.shutdown()
    leftovers += _leftover_processes()
    total_s = time.perf_counter() - start
    print(f"[peak memory: {memory.peak_bytes / 2**30:.2f} GiB summed PSS over {memory.peak_processes} processes "
          f"(Ray included); wall time {total_s:.1f} s]")
    if leftovers:
        print(f"[processes left behind: {leftovers}]", file=sys.stderr)
        return 1
    print("[shut down cleanly: no actor, placement group or process left]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
