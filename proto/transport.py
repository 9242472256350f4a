"""What every gRPC server and channel of shardserve's shares: message-size options and address formatting."""

from __future__ import annotations

import socket

import grpc

# Large plans (a batch of long prompts) and results (logprobs) exceed gRPC's 4 MiB default: no limit either way.
MESSAGE_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def host_port(host: str, port: int) -> str:
    """"host:port" as gRPC targets and bind addresses spell it (an IPv6 host goes in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now (for a rendezvous that needs its port before it listens)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_channel(endpoint: str, secret: str, tls=None) -> grpc.Channel:
    """A channel to a Worker server whose every call carries the launch's secret (proto/auth.py); over mutual TLS
    when tls (proto.auth.WorkerTLS) is given."""
    from shardserve.proto.auth import WORKER_SECRET_KEY, AddMetadata

    if tls is None:
        channel = grpc.insecure_channel(endpoint, options=MESSAGE_OPTIONS)
    else:
        channel = grpc.secure_channel(endpoint, tls.channel(), options=MESSAGE_OPTIONS + tls.channel_options())
    return grpc.intercept_channel(channel, AddMetadata(WORKER_SECRET_KEY, secret))
