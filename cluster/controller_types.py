"""The controller's and the fronts' settings and their per-request records: what `shardserve serve` hands the
controller actor (ControllerConfig, ServedModel), what each front gets (FrontSettings) and what a front keeps per
live request (LiveRequest, StreamItem)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardserve.cluster.api_security import ApiSecurity
from shardserve.cluster.engine import Engine
from shardserve.cluster.outputs import RequestDelta
from shardserve.cluster.replica import Replica
from shardserve.proto.config import EngineConfig


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class ServedModel:
    """The model facts clients see in GetModelInfo."""

    name: str
    architecture: str
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None = None


@dataclass
class ControllerConfig:
    engine: EngineConfig
    model: ServedModel
    # One replica's factory, called once per replica start, in the controller, off its event loop: loads the
    # tokenizer, starts and connects to the group's workers (returning once every rank has loaded and allocated
    # its cache) and builds the Engine; the engine's shutdown stops the group. `shardserve serve` passes
    # shardserve/launch/ray_serving.py's RayGroupFactory (over engine_factory.py's build_engine, the one engine wiring).
    build_engine: Callable[[EngineConfig], Engine]
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port
    metrics_port: int | None = None  # None = no /metrics endpoint; 0 = any free port
    name: str = "replica"  # replica i is "{name}/{i}", named in every stream's last message
    num_replicas: int = 1
    routing: str = "cache-aware"  # cluster/router.py POLICIES
    health_check_interval_s: float = 5.0  # how often the workers are asked, so an idle server notices a dead rank
    max_live_requests: int = 4096  # admission limit: beyond it Generate answers RESOURCE_EXHAUSTED (read per call)
    security: ApiSecurity = field(default_factory=ApiSecurity)  # the client API's token, TLS and size limits
    restart_tries: int = 3  # new TP groups tried after a group fails (0: a failed group fails its replica)
    restart_backoff_s: float = 1.0  # the wait before the second try, doubled after each
    # After a stream's first tokens, it sends a message once it has this many new tokens (or its end): fewer
    # messages, each costing the server and client more than its tokens do, at the price of burstier arrival.
    stream_interval: int = 1
    # Where each replica's Engine and EngineLoop run: None = threads of the controller process; else a factory of
    # host processes (start(replica_id, engine, build_engine, health_s, restart_tries, backoff_s) -> a Ray actor
    # handle running cluster/replica_host.py's ReplicaHost; kill(handle)): shardserve/launch/replica_actors.py.
    replica_hosts: object | None = None
    # With replica hosts: the front processes that serve the client API (start(k, *FrontProcess args), find(k),
    # kill(handle), count): shardserve/launch/front_actors.py's RayFronts.
    fronts: object | None = None


@dataclass
class FrontSettings:
    """One front's settings (cluster/front.py): the client API's side of ControllerConfig."""

    engine: EngineConfig
    model: ServedModel
    num_replicas: int
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port; several fronts on one port share it (SO_REUSEPORT)
    routing: str = "cache-aware"
    max_live_requests: int = 4096  # this front's admission limit (its share of the cluster's)
    stream_interval: int = 1
    security: ApiSecurity = field(default_factory=ApiSecurity)


@dataclass(slots=True)
class StreamItem:
    delta: RequestDelta


@dataclass
class LiveRequest:
    req_id: str
    queue: asyncio.Queue  # StreamItem, or an exception that ends the stream
    admitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_prompt_tokens: int = 0
    seed: int | None = None  # its sampling seed: the request's, or the one drawn at admission (told in Started)
    replica: Replica | None = None  # where it runs
    cost: int = 0  # what it adds to its replica's outstanding tokens
    final_only: bool = False  # its tokens come in one delta at the end (SamplingParams.final_only)
    prompt_text: str = ""  # with echo: the prompt as text, and its first token's (GenerateRequest.echo)
    prompt_first_token_text: str = ""
