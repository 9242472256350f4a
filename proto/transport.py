"""What every gRPC server and channel of shardserve's shares: message-size options and address formatting."""

from __future__ import annotations

import os
import random
import socket
import time

import grpc

# Large plans (a batch of long prompts) and results (logprobs) exceed gRPC's 4 MiB default: no limit either way.
MESSAGE_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def host_port(host: str, port: int) -> str:
    """"host:port" as gRPC targets and bind addresses spell it (an IPv6 host goes in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# Ports a rendezvous takes: above Ray's worker ports (10002-19999 by default), below the kernel's ephemeral range.
_QUIET_PORTS_FROM = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now, for a rendezvous (or a server) that needs its port before it listens.

    Taken at random below the kernel's ephemeral range (Linux: ip_local_port_range) and above Ray's worker ports:
    a port from the ephemeral range, found free, can be handed to any outgoing connection before its listener binds
    it (one was, in a test, while Ray started), where no connection is ever given a port below that range. Off
    Linux, or where the range starts too low to leave room, any free port (bind to 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    rng = random.Random(os.getpid() ^ time.time_ns())
    low = _ephemeral_low()
    for _ in range(100 if low > _QUIET_PORTS_FROM + 1000 else 0):
        port = rng.randrange(_QUIET_PORTS_FROM, low)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def worker_channel(endpoint: str, secret: str, tls=None) -> grpc.Channel:
    """A channel to a Worker server whose every call carries the launch's secret (proto/auth.py); over mutual TLS
    when tls (proto.auth.WorkerTLS) is given."""
    from shardserve.proto.auth import WORKER_SECRET_KEY, AddMetadata

    if tls is None:
        channel = grpc.insecure_channel(endpoint, options=MESSAGE_OPTIONS)
    else:
        channel = grpc.secure_channel(endpoint, tls.channel(), options=MESSAGE_OPTIONS + tls.channel_options())
    return grpc.intercept_channel(channel, AddMetadata(WORKER_SECRET_KEY, secret))
