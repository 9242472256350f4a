"""How Client and AsyncClient (shardserve/client/clients.py) reach a server: a bearer token added to every call's metadata
(`authorization: Bearer <token>`), and TLS, mutual when a client certificate is given."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from shardserve.proto.auth import AUTHORIZATION_KEY, AddMetadata, async_add_metadata, bearer, channel_credentials


@dataclass(frozen=True)
class Connection:
    """How a client reaches its server: an optional bearer token, optional TLS (mutual with a client cert)."""

    token: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_root_cert: str | bytes | None = field(default=None, repr=False)
    tls_client_cert: str | bytes | None = field(default=None, repr=False)
    tls_client_key: str | bytes | None = field(default=None, repr=False)

    def _credentials(self):
        if not (self.tls or self.tls_root_cert or self.tls_client_cert or self.tls_client_key):
            return None
        return channel_credentials(self.tls_root_cert, self.tls_client_cert, self.tls_client_key)

    def channel(self, address: str) -> grpc.Channel:
        creds = self._credentials()
        channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        if self.token is None:
            return channel
        return grpc.intercept_channel(channel, AddMetadata(AUTHORIZATION_KEY, bearer(self.token)))

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        creds = self._credentials()
        interceptors = None if self.token is None else async_add_metadata(AUTHORIZATION_KEY, bearer(self.token))
        if creds:
            return grpc.aio.secure_channel(address, creds, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, interceptors=interceptors)
