"""A minimal asyncio HTTP/1.1 client for the benchmark: POST a JSON body, read the server-sent events back over
kept-alive connections. The benchmark measures the gateway, so its own client stays small (no per-request client
objects, no extra packages on the GPU hosts); it speaks just what uvicorn answers: chunked or sized bodies."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:500].decode(errors='replace')}")
        self.status = status
        self.body = body


class SseClient:
    """POSTs to one base URL (http://host:port[/prefix]); idle connections are reused."""

    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise ValueError(f"only http:// URLs are supported, got {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def events(self, path: str, payload: dict) -> AsyncIterator[bytes]:
        """Yields each event's data (the bytes after "data: ") as it arrives; raises HttpError for a non-200."""
        body = json.dumps(payload).encode()
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n")
        reader, writer = self._idle.pop() if self._idle else await asyncio.open_connection(self.host, self.port)
        reusable = False
        try:
            writer.write(head.encode() + body)
            status, headers = await _read_head(reader)
            chunks = _read_body(reader, headers)
            if status != 200:
                raise HttpError(status, b"".join([c async for c in chunks]))
            pending = b""
            async for chunk in chunks:
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if line.startswith(b"data: "):
                            yield line[6:]
            reusable = headers.get("connection", "").lower() != "close"
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers, if any
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()
