"""`shardserve serve` (the cluster), added to shardserve/cli/main.py's parser."""

from __future__ import annotations

import argparse
import os
import sys

from shardserve.cli.connection_flags import API_KEY_ENV, token_of
from shardserve.cli.flags import add_engine_args, engine_kwargs


def add_cluster_parsers(sub) -> None:
    serve = sub.add_parser("serve", help="serve a model over gRPC from a Ray cluster (tensor-parallel workers)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as vLLM's `serve MODEL` takes it: the same as --model")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="the client API's bind address")
    serve.add_argument("--port", type=int, default=50051, help="the client API's port (0 = any free port)")
    serve.add_argument("--worker-host", default="127.0.0.1",
                       help="the workers' bind address: 127.0.0.1 on one machine; 'node' = each worker's own node "
                       "address (multi-node clusters); 0.0.0.0 = every interface")
    serve.add_argument("--ray-address", default=None,
                       help="'local' starts a Ray here; 'auto' or an address joins one "
                       "(default: join this node's cluster if there is one, else local)")
    serve.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics on this port")
    serve.add_argument("--max-live-requests", type=int, default=4096,
                       help="admission limit: requests beyond it are refused with RESOURCE_EXHAUSTED")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may take to finish after SIGTERM")
    serve.add_argument("--placement-strategy", default="STRICT_PACK",
                       choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
                       help="Ray's strategy for each TP group's placement group (--placement sets it)")
    serve.add_argument("--placement", choices=["pack", "spread"], default=None,
                       help="pack (default): each TP group on one node; spread: a TP group may span nodes (its "
                       "all-reduces then run at network speed)")
    serve.add_argument("--replicas", default="1",
                       help="tensor-parallel groups (engine replicas) to run, each with its own KV cache: a number, "
                       "or 'auto' (as many as the cluster's GPUs hold; one per node on CPU)")
    serve.add_argument("--routing", default="cache-aware", choices=["cache-aware", "least-loaded", "round-robin"],
                       help="how the controller picks a replica for each request")
    serve.add_argument("--stream-interval", type=int, default=1,
                       help="after a stream's first tokens, send a message once it has this many new tokens (or "
                            "its end): fewer, larger messages when the server's CPU is the limit")
    serve.add_argument("--replica-hosts", default="auto", choices=["auto", "process", "controller"],
                       help="where each replica's scheduler and engine loop run: process (a Ray actor of its own "
                       "beside the controller, so replicas' host work uses several cores), controller (threads of "
                       "the controller process), auto (process when there is more than one replica)")
    serve.add_argument("--fronts", type=int, default=1,
                       help="with replica host processes: front processes serving the client API on --port (they "
                       "route and stream straight from the replicas; the controller never carries a token)")
    serve.add_argument("--served-model-name", default=None, help="the name GetModelInfo reports")
    serve.add_argument("--dry-run", action="store_true",
                       help="print the placement report (each pipeline stage's layers, weight and KV bytes per GPU) "
                       "and exit: nothing is loaded or started")
    serve.add_argument("--gpu-memory-gb", type=float, default=80.0,
                       help="--dry-run: the memory of one GPU in GiB (80: H100, 141: H200)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="also serve the OpenAI-compatible HTTP gateway on this port (0 = any free port)")
    serve.add_argument("--http-host", default=None, help="the gateway's bind address (default: --host)")
    serve.add_argument("--step-timeout-floor", type=float, default=10.0,
                       help="seconds a step may always take before its TP group counts as hung and is restarted")
    serve.add_argument("--step-timeout-factor", type=float, default=10.0,
                       help="beyond the floor, a step may take this many times the recent 99th-percentile step time")
    serve.add_argument("--http-workers", type=int, default=1,
                       help="gateway processes on the HTTP port: a thread of this one, plus N-1 (`gateway --workers`)")
    from shardserve.gateway.request_limits import add_limit_flags

    add_limit_flags(serve.add_argument_group("the HTTP gateway's limits (docs/security.md; its body limit is "
                                             "--max-request-bytes, the server's)"), prefix="http-",
                    skip=("max_request_bytes",))
    api = serve.add_argument_group("client API security (docs/security.md)")
    api.add_argument("--auth-token-file", default=None, metavar="PATH",
                     help="clients must send 'authorization: Bearer <the token in this file>' (health stays open)")
    api.add_argument("--api-key", default=None, metavar="KEY",
                     help="the token itself, as vLLM spells it (visible to `ps`: prefer $" + API_KEY_ENV + " or "
                     "--auth-token-file); default: the environment variable " + API_KEY_ENV)
    api.add_argument("--tls-cert", default=None, metavar="PEM", help="serve the client API over TLS with this certificate")
    api.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    api.add_argument("--tls-client-ca", default=None, metavar="PEM",
                     help="mutual TLS: clients must present a certificate this CA signed")
    plane = serve.add_argument_group("worker plane TLS (docs/security.md): the same paths on every node")
    plane.add_argument("--worker-tls-cert", default=None, metavar="PEM",
                       help="mutual TLS between the controller and its workers: the certificate both present")
    plane.add_argument("--worker-tls-key", default=None, metavar="PEM", help="the private key of --worker-tls-cert")
    plane.add_argument("--worker-tls-ca", default=None, metavar="PEM",
                       help="the CA that signed --worker-tls-cert: each side accepts only certificates it signed")
    plane.add_argument("--worker-tls-server-name", default="shardserve-worker", metavar="NAME",
                       help="the name the controller checks in the workers' certificate (its subjectAltName)")
    api.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                     help="a request message larger than this is refused with RESOURCE_EXHAUSTED (default 4 MiB)")
    api.add_argument("--max-prompt-bytes", type=int, default=None, metavar="N",
                     help="prompt text longer than this is refused (INVALID_ARGUMENT) before it is tokenized "
                     "(default: 32 bytes per token of max_model_len, at least 64 KiB)")
    serve.set_defaults(func=cmd_serve)



def api_security(args: argparse.Namespace):
    """The serve command's ApiSecurity (a ValueError naming the flag when the files do not make sense)."""
    from shardserve.cluster.api_security import DEFAULT_MAX_REQUEST_BYTES, ApiSecurity

    for flag in ("auth_token_file", "tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file")
    if args.tls_cert and args.http_port is not None:
        raise ValueError("--http-port with --tls-cert: run `shardserve gateway --upstream-tls-ca ...` instead")
    token = token_of(args.auth_token_file, args.api_key, "--auth-token-file")
    return ApiSecurity(token=token, tls_cert=args.tls_cert, tls_key=args.tls_key, client_ca=args.tls_client_ca,
                       max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
                       max_prompt_bytes=args.max_prompt_bytes)


def worker_tls(args: argparse.Namespace):
    """The serve command's proto.auth.WorkerTLS, or None (a ValueError naming the flags when only some are given or
    a file cannot be read here)."""
    from shardserve.proto.auth import WorkerTLS

    files = (args.worker_tls_cert, args.worker_tls_key, args.worker_tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise ValueError("--worker-tls-cert, --worker-tls-key and --worker-tls-ca go together: give all three")
    tls = WorkerTLS(*files, server_name=args.worker_tls_server_name)
    tls.check_readable()
    return tls


def _check_port_free(host: str, port: int | None, flag: str) -> None:
    """A port another process holds is refused before Ray starts (a ValueError: one line naming the flag)."""
    import socket

    if not port:  # None or 0 (any free port)
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                             f"is another server using it? Pick another {flag}") from None


def _dry_run(args: argparse.Namespace) -> int:
    """The placement report for GPUs (device and dtype "auto" taken as CUDA's), without starting anything."""
    from shardserve.launch.stage_report import placement_report
    from shardserve.settings.model_source import display_name
    from shardserve.settings.resolve import build_engine_config

    if args.gpu_memory_gb <= 0:
        raise ValueError(f"--gpu-memory-gb {args.gpu_memory_gb}: give a size > 0")
    kwargs = engine_kwargs(args)
    if kwargs.get("device") == "auto":
        kwargs["device"] = "cuda"
    config = build_engine_config(**kwargs)
    print(placement_report(config, args.gpu_memory_gb, display_name(args.model)), flush=True)
    return 0


def positional_model(args: argparse.Namespace) -> None:
    """`serve MODEL` as vLLM spells it: the positional model into --model's place (both, differing: a ValueError)."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}; give one")
    args.model = tag


def cmd_serve(args: argparse.Namespace) -> int:
    from shardserve.cluster.step_deadline import StepDeadline
    from shardserve.settings.resolve import build_engine_config
    from shardserve.launch.local_ray import exit_past_broken_ray
    from shardserve.launch.server_process import serve

    positional_model(args)
    if args.dry_run:
        return _dry_run(args)
    _check_port_free(args.host, args.port, "--port")
    if args.metrics_port:
        _check_port_free("0.0.0.0", args.metrics_port, "--metrics-port")
    if args.http_port:
        _check_port_free(args.http_host or args.host, args.http_port, "--http-port")
    from shardserve.settings.model_source import display_name

    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval {args.stream_interval}: give a number >= 1")
    if args.replicas != "auto" and not (args.replicas.isdigit() and int(args.replicas) >= 1):
        raise ValueError(f"--replicas {args.replicas}: give a number >= 1 or 'auto'")
    security = api_security(args)
    plane_tls = worker_tls(args)
    from shardserve.gateway.request_limits import limits_from_args

    http_limits = limits_from_args(args, "http-", max_request_bytes=security.max_request_bytes)
    config = build_engine_config(**engine_kwargs(args))
    strategy = args.placement_strategy
    if args.placement == "spread":
        strategy = "SPREAD"
        print("shardserve: warning: --placement spread lets a tensor-parallel group span nodes; its all-reduces "
              "then cross the network and run at network speed", file=sys.stderr, flush=True)
    elif args.placement == "pack":
        strategy = "STRICT_PACK"
    code = serve(config, replicas=args.replicas, routing=args.routing, ray_address=args.ray_address,
                 host=args.host, port=args.port, worker_host=args.worker_host, metrics_port=args.metrics_port,
                 drain_timeout_s=args.drain_timeout,
                 strategy=strategy, model_name=args.served_model_name or display_name(args.model),
                 max_live_requests=args.max_live_requests, http_port=args.http_port, http_host=args.http_host,
                 http_workers=args.http_workers, http_limits=http_limits, security=security,
                 step_deadline=StepDeadline(floor_s=args.step_timeout_floor, factor=args.step_timeout_factor),
                 stream_interval=args.stream_interval, worker_tls=plane_tls, replica_hosts=args.replica_hosts,
                 fronts=args.fronts)
    return exit_past_broken_ray(code)  # a Ray that died under serve: no interpreter finalization (it crashed)
