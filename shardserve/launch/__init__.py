"""Starting shardserve on Ray: the `serve` process (server_process.py), the controller and its worker groups
(ray_serving.py), a group's placement (placement.py), the local Ray (local_ray.py) and replica host actors
(replica_actors.py). Named apart from cluster/, which is the controller side of the engine."""
