"""How long a lost worker costs: `python -m shardserve.bench.fault_recovery [--tp 3] [--streams 16]`.

Starts the cluster (the default model unless --model, CPU, a local Ray) as `shardserve serve` does, runs the
streams once undisturbed, then again, SIGKILLing one worker actor once every stream has a few tokens. Prints one
JSON line: the longest pause a stream saw (from the kill to its next token), the time until health was SERVING
again, and whether every stream finished with exactly its undisturbed tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time


def _streams(address: str, n: int, max_tokens: int, kill=None) -> tuple[list[list[int]], list[float]]:
    """Runs n streams (half greedy, half seeded); with kill, calls it once every stream has 4 tokens and returns,
    per stream, the tokens and the pause from the kill to its next token."""
    from shardserve.client.clients import Client

    tokens: list[list[int]] = [[] for _ in range(n)]
    pauses = [0.0] * n
    killed_at: list[float] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, seed=100 + i)
        try:
            with Client(address, timeout=600) as client:
                for delta in client.stream(f"Story {i}: once upon a time", max_tokens=max_tokens, ignore_eos=True,
                                           **sampling):
                    if killed_at and not pauses[i]:
                        pauses[i] = time.monotonic() - killed_at[0]
                    tokens[i] += delta.token_ids
        except BaseException as e:  # noqa: BLE001 (reported)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    if kill is not None:
        while min(len(t) for t in tokens) < 4 and not errors:
            time.sleep(0.01)
        killed_at.append(time.monotonic())
        kill()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} stream(s) failed: {errors[0]!r}")
    return tokens, pauses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    import ray

    from shardserve.client.clients import Client
    from shardserve.settings.resolve import build_engine_config
    from shardserve.launch.local_ray import LocalRay
    from shardserve.launch.ray_serving import start_cluster

    host = LocalRay.start(num_cpus=max(8, os.cpu_count() or 1))
    ray.init(address=host.address, logging_level="warning")
    config = build_engine_config(model=args.model, tensor_parallel_size=args.tp, device="cpu",
                                 max_num_seqs=args.streams)
    cluster = start_cluster(config, host="127.0.0.1", port=0)
    try:
        undisturbed, _ = _streams(cluster.address, args.streams, args.max_tokens)
        (rank1,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith(cluster.name) and a["name"].endswith("-rank1")]
        victim = ray.get(ray.get_actor(rank1["name"], namespace=rank1["namespace"]).pid.remote(), timeout=60)
        back: list[float] = []
        client = Client(cluster.address, timeout=30)

        def kill() -> None:
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)

            def watch() -> None:  # health: NOT_SERVING once the loss is seen, then SERVING again
                seen_down = False
                while not back:
                    status = client.health()
                    seen_down = seen_down or status == "NOT_SERVING"
                    if seen_down and status == "SERVING":
                        back.append(time.monotonic() - killed)
                    time.sleep(0.02)

            threading.Thread(target=watch, daemon=True).start()

        disturbed, pauses = _streams(cluster.address, args.streams, args.max_tokens, kill)
        print(json.dumps({
            "model": os.path.basename(config.model.rstrip("/")), "tp": args.tp, "streams": args.streams,
            "longest_pause_s": round(max(pauses), 2), "serving_again_s": round(back[0], 2) if back else None,
            "outputs_equal": disturbed == undisturbed, "group_restarts": cluster.status()["group_restarts"],
        }))
        client.close()
    finally:
        cluster.shutdown(drain_timeout_s=0)
        ray.shutdown()
        host.stop()


if __name__ == "__main__":
    main()
