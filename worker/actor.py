"""WorkerActor: the Ray actor that hosts one rank's Worker gRPC server in its own process.

A plain class: shardserve/launch/placement.py applies ray.remote (with the placement-group bundle and the environment),
so importing this file needs no Ray (nor torch). Ray only places the process and tells the controller the
endpoint; every step then travels over gRPC (worker/worker_service.py), never through Ray's object store.
"""

from __future__ import annotations

import os

from shardserve.proto.transport import free_port, host_port


class WorkerActor:
    def __init__(self, worker_host: str = "127.0.0.1", num_threads: int | None = None, *, secret: str,
                 tls=None) -> None:
        """Starts the Worker server bound to worker_host on an ephemeral port: 127.0.0.1 on one machine; "node"
        binds each worker to its own node's address (what a multi-node cluster wants), "0.0.0.0" to every
        interface. num_threads: torch's intra-op threads (on CPU, the host's cores / TP ranks on it).
        secret: the launch's worker-plane secret (an actor argument: never logged, not kept on the actor).
        tls: proto.auth.WorkerTLS (file paths, read on this node) for mutual TLS with the controller, or None."""
        from shardserve.worker.distributed import prepare_worker_process
        from shardserve.worker.worker_service import serve_worker

        prepare_worker_process(num_threads)  # the launcher's runtime_env sets the same; this covers other starts
        if worker_host == "node":
            worker_host = self.node_ip()
        self.worker_host = worker_host
        self._server, self._address = serve_worker(worker_host, 0, secret=secret, tls=tls)

    def endpoint(self) -> str:
        """The Worker server's "host:port" (the node's address when bound to every interface)."""
        if self.worker_host in ("0.0.0.0", "::", ""):
            return host_port(self.node_ip(), int(self._address.rsplit(":", 1)[1]))
        return self._address

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def placement_group_id(self) -> str | None:
        import ray

        return ray.get_runtime_context().get_placement_group_id()

    def free_port(self) -> int:
        """A port free on this node right now (rank 0's node hosts the torch.distributed rendezvous)."""
        return free_port(self.worker_host)

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> str:
        return "pong"

    def stop(self) -> None:
        """Stops the gRPC server (the launcher kills the actor afterwards)."""
        self._server.stop(grace=1.0)
