"""The gRPC client of a shardserve server (clients.py: Client, AsyncClient; stream.py: streams and resuming;
connection.py: tokens and TLS). Importing it needs only grpcio and protobuf (no torch).

    from shardserve.client import Client
"""

from shardserve.client.clients import AsyncClient, Client, FieldError, build_request
from shardserve.client.stream import AsyncStream, GenerationResult, Stream, StreamDelta, Usage

__all__ = ["Client", "AsyncClient", "FieldError", "build_request",
           "GenerationResult", "StreamDelta", "Usage", "Stream", "AsyncStream"]
