"""`shardserve gateway`: the OpenAI-compatible HTTP gateway (shardserve/gateway/app.py) in front of a running server.
Kept apart from gateway.py so that building the command line needs no FastAPI."""

from __future__ import annotations

import argparse


def add_gateway_parser(sub) -> None:
    gateway = sub.add_parser("gateway", help="an OpenAI-compatible HTTP API in front of a running `shardserve serve`")
    gateway.add_argument("--upstream", default="127.0.0.1:50051", metavar="HOST:PORT", help="the gRPC server")
    gateway.add_argument("--host", default="127.0.0.1", help="the HTTP bind address")
    gateway.add_argument("--port", type=int, default=8000, help="the HTTP port (0 = any free port)")
    gateway.add_argument("--request-timeout", type=float, default=None,
                         help="deadline of each upstream request, seconds (past it: 504, the server frees it)")
    gateway.add_argument("--access-log", action="store_true", help="log every HTTP request")
    gateway.add_argument("--workers", type=int, default=1,
                         help="gateway processes sharing the port (SO_REUSEPORT): one core's worth of streams each")
    gateway.add_argument("--worker-of-parent", action="store_true", help=argparse.SUPPRESS)  # started by --workers
    from shardserve.cli.connection_flags import add_connection_args
    from shardserve.gateway.request_limits import add_limit_flags

    add_connection_args(gateway.add_argument_group("upstream TLS (a server's token comes from each HTTP request's "
                                                   "Authorization header)"), prefix="upstream-")
    add_limit_flags(gateway.add_argument_group("limits: what one request or connection may cost (docs/security.md)"))
    gateway.set_defaults(func=cmd_gateway)


def cmd_gateway(args: argparse.Namespace) -> int:
    from shardserve.cli.connection_flags import connection_kwargs
    from shardserve.gateway.app import run_gateway
    from shardserve.gateway.request_limits import limits_from_args

    tls = connection_kwargs(args, prefix="upstream-")
    tls.pop("token")
    return run_gateway(args.upstream, args.host, args.port, args.request_timeout, args.access_log, args.workers,
                       args.worker_of_parent, upstream_tls=tls, limits=limits_from_args(args))
