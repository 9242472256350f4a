"""Front processes on Ray: each a detached named actor running cluster/front_process.py's FrontProcess, on the
client API's port (the first binds it, the others share it: SO_REUSEPORT), on the node of `serve` (hard node
affinity: --host is an address of that machine). Detached, so the controller's death leaves them serving; a
restarted controller finds them by name.

    fronts = RayFronts(name="shardserve-1a2b", node_id=...)   # picklable: travels inside ControllerConfig
    handle = fronts.start(0, FrontProcess args...)
    fronts.find(0), fronts.kill(handle)
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.launch.replica_actors import NAMESPACE


@dataclass
class RayFronts:
    name: str  # the cluster's name: front k is "{name}-front{k}"
    node_id: str | None = None  # the node they run on (None: anywhere)
    count: int = 1

    def _name(self, k: int) -> str:
        return f"{self.name}-front{k}"

    def start(self, k: int, *args):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from shardserve.cluster.front_process import FrontProcess

        options = dict(name=self._name(k), namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=0,
                       max_concurrency=10000)
        if self.node_id is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=self.node_id, soft=False)
        return ray.remote(FrontProcess).options(**options).remote(*args)

    def find(self, k: int):
        import ray

        try:
            return ray.get_actor(self._name(k), namespace=NAMESPACE)
        except ValueError:
            return None

    def kill(self, handle) -> None:
        import ray

        try:
            ray.kill(handle, no_restart=True)
        except Exception:
            pass


def sweep(name: str) -> int:
    """Ends every detached actor and placement group of the cluster `name` (fronts, hosts and their groups): what a
    dead controller could not stop. Returns how many actors it ended."""
    import ray
    from ray.util.placement_group import get_placement_group, placement_group_table, remove_placement_group

    ended = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(f"{name}-"):
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
                ended += 1
            except Exception:
                pass
    for info in placement_group_table().values():
        if (info.get("name") or "").startswith(f"{name}-") and info.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(info["name"]))
            except Exception:
                pass
    return ended
