"""Run by test_netns_nodes.py in a process of its own (as root): two Ray nodes with addresses of their own, each
raylet in a network namespace of its own, the two joined by a veth pair (10.231.x.1 and .2); nothing binds
outside the namespaces, and their traffic never leaves the machine.

    python tests/e2e/_netns_nodes.py MODEL_DIR            # sets up, runs the driver in namespace A, tears down
    python tests/e2e/_netns_nodes.py --driver MODEL_DIR ADDRESS   # (inside namespace A) the cluster part

The driver starts a TP=2 group with its ranks on the two nodes (STRICT_SPREAD) and `--worker-host node` (each
rank's Worker server on its own node's address), generates greedily, then does the same at TP=1, and prints one
JSON line: the nodes' addresses, the TP=2 group's endpoints and rendezvous, and both runs' tokens. Exit code 3:
namespaces cannot be made here (the test skips with the reason).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time

RAY_CLI = 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; main()'


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def main(model_dir: str) -> int:
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b, veth_a, veth_b = f"ssA{tag}", f"ssB{tag}", f"ssva{tag}", f"ssvb{tag}"
    net = f"10.231.{random.randrange(1, 250)}"
    addr_a, addr_b = f"{net}.1", f"{net}.2"
    made: list[str] = []
    procs: list[subprocess.Popen] = []
    try:
        try:
            for ns in (ns_a, ns_b):
                _ip("netns", "add", ns)
                made.append(ns)
            _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
            _ip("link", "set", veth_a, "netns", ns_a)
            _ip("link", "set", veth_b, "netns", ns_b)
            for ns, veth, addr in ((ns_a, veth_a, addr_a), (ns_b, veth_b, addr_b)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
                _ip("-n", ns, "link", "set", veth, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"network namespaces cannot be made here: {getattr(e, 'stderr', None) or e}", file=sys.stderr)
            return 3
        # Inside the namespaces only their own addresses exist: the multi-node setting binds nothing else.
        temp = f"/tmp/ss-netns-{tag}"
        # A token of this run's own for the cluster (Ray may otherwise pick up a token file of the machine's).
        env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_ADDRESS="", SS_NETNS_TEMP=temp,
                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        port = 6300 + random.randrange(600)
        common = ["--block", "--num-cpus", "1", "--disable-usage-stats", f"--temp-dir={temp}"]
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns_a, sys.executable, "-c", RAY_CLI, "start", "--head", "--port", str(port),
             "--node-ip-address", addr_a, "--include-dashboard=false", *common],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_for_port(ns_a, addr_a, port)
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns_b, sys.executable, "-c", RAY_CLI, "start", "--address", f"{addr_a}:{port}",
             "--node-ip-address", addr_b, *common],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        driver = subprocess.run(
            ["ip", "netns", "exec", ns_a, sys.executable, __file__, "--driver", model_dir, f"{addr_a}:{port}"],
            env=env, capture_output=True, text=True, timeout=500)
        sys.stderr.write(driver.stderr[-4000:])
        print(driver.stdout.strip().splitlines()[-1] if driver.stdout.strip() else "{}")
        return driver.returncode
    finally:
        for proc in reversed(procs):  # the raylets we started, by their process groups
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in made:  # deleting a namespace deletes the veth end in it, and with it the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(f"/tmp/ss-netns-{tag}", ignore_errors=True)


def _wait_for_port(ns: str, host: str, port: int, timeout_s: float = 60.0) -> None:
    probe = f"import socket; socket.create_connection(('{host}', {port}), timeout=1).close()"
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True).returncode:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the head raylet did not listen on {host}:{port} within {timeout_s:.0f} s")
        time.sleep(0.5)


def driver(model_dir: str, address: str) -> None:
    import ray

    from shardserve.client.clients import Client
    from shardserve.settings.resolve import build_engine_config
    from shardserve.launch.ray_serving import start_cluster

    ray.init(address=address, logging_level="warning", log_to_driver=False, _temp_dir=os.environ["SS_NETNS_TEMP"])
    deadline = time.monotonic() + 60
    while sum(1 for n in ray.nodes() if n["Alive"]) < 2:
        assert time.monotonic() < deadline, "the second node did not join"
        time.sleep(0.5)
    report: dict = {"node_addresses": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])}
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    for tp in (2, 1):
        config = build_engine_config(model=model_dir, device="cpu", dtype="float32", tensor_parallel_size=tp,
                                     num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=64)
        running = start_cluster(config, host="127.0.0.1", port=0, worker_host="node",
                                strategy="STRICT_SPREAD" if tp == 2 else "STRICT_PACK")
        try:
            if tp == 2:
                (group,) = ray.get(running.controller.worker_groups.remote())
                report["endpoints"], report["init_method"] = group.endpoints, group.init_method
            with Client(running.address, timeout=120) as client:
                report[f"tokens_tp{tp}"] = client.generate(prompt, temperature=0, max_tokens=8).token_ids
        finally:
            running.shutdown(drain_timeout_s=0)
    ray.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1] == "--driver":
        driver(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main(sys.argv[1]))
