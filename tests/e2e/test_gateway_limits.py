"""The gateway under abuse (shardserve/gateway/request_limits.py, connections.py), against the fake upstream of
test_gateway_fake_upstream.py, with small limits so that each case ends in well under a second: an oversized body
is refused from its Content-Length before it is read, a chunked one at the limit; a body that is not JSON, too many
prompts, headers too large; headers or a body that trickle, a body shorter than its Content-Length, an idle
connection: each closed at its timeout; connections past the cap answered 503; every refusal counted by reason."""

from __future__ import annotations

import argparse
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from shardserve.gateway.app import GatewayThread
from shardserve.gateway.request_limits import GatewayLimits, add_limit_flags, limits_from_args
from shardserve.proto import generation_pb2_grpc as pb_grpc
from tests.e2e.test_gateway_fake_upstream import FakeGeneration

LIMITS = GatewayLimits(max_request_bytes=64 * 1024, max_prompts=8, max_header_bytes=4096, header_timeout_s=0.5,
                       body_timeout_s=0.5, keep_alive_s=0.5, max_connections=6)
WAIT_S = 30  # how long a test waits for the gateway to act: far past every limit's timeout


@pytest.fixture(scope="module")
def gateway():
    """(host, port, base URL, uvicorn's server state) of a gateway with LIMITS in front of the fake upstream."""
    server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    gateway = GatewayThread(f"127.0.0.1:{port}", "127.0.0.1", 0, limits=LIMITS)
    host, http_port = gateway.address.rsplit(":", 1)
    try:
        yield host, int(http_port), f"http://{gateway.address}", gateway._server.server_state
    finally:
        gateway.stop()
        server.stop(None)


def _connect(gateway) -> socket.socket:
    conn = socket.create_connection(gateway[:2])
    conn.settimeout(WAIT_S)
    return conn


def _answer(conn: socket.socket) -> bytes:
    """What the gateway sends until it closes the connection (b"" for a close without a word)."""
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _status(answer: bytes) -> int | None:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


def _refused(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=WAIT_S).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'refused_total\{reason="(\w+)"\} (\S+)', text)}


def test_a_body_over_the_limit_is_413_from_its_content_length_before_it_is_sent(gateway):
    """The headers alone announce 200 MB: the answer comes without a byte of the body (a client using Expect:
    100-continue, or one still sending, learns at once), and the connection closes."""
    conn = _connect(gateway)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 209715200\r\n\r\n")
    answer = _answer(conn)
    assert _status(answer) == 413 and b"request_too_large" in answer and b"connection: close" in answer.lower()


def test_a_chunked_body_is_cut_off_at_the_limit(gateway):
    def body():
        yield b'{"prompt": "'
        for _ in range(1000):  # 64 MB if it were all read
            yield b"x" * 65536

    reply = httpx.post(f"{gateway[2]}/v1/completions", content=body(), timeout=WAIT_S,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    small = httpx.post(f"{gateway[2]}/v1/completions", json={"prompt": "x" * 60_000}, timeout=WAIT_S)
    assert small.status_code == 200  # under the limit: served


def test_a_body_that_is_not_json_is_415_naming_the_content_type(gateway):
    reply = httpx.post(f"{gateway[2]}/v1/completions", content=b'{"prompt": "hi"}', timeout=WAIT_S,
                       headers={"content-type": "application/x-www-form-urlencoded"})
    assert reply.status_code == 415 and "application/x-www-form-urlencoded" in reply.json()["error"]["message"]


def test_more_prompts_than_the_limit_is_a_400_on_prompt_at_once(gateway):
    reply = httpx.post(f"{gateway[2]}/v1/completions", json={"prompt": ["a"] * 5000}, timeout=WAIT_S)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt" and "at most 8 prompts" in error["message"] and "5000" in error["message"]
    assert httpx.post(f"{gateway[2]}/v1/completions", json={"prompt": ["a"] * 8}, timeout=WAIT_S).status_code == 200


def test_headers_over_the_limit_are_431_whole_or_still_arriving(gateway):
    reply = httpx.get(f"{gateway[2]}/health", headers={"x-big": "a" * 100_000}, timeout=WAIT_S)
    assert reply.status_code == 431 and "4096" in reply.json()["error"]["message"]
    conn = _connect(gateway)  # a header that never ends: refused at the limit, not buffered
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: " + b"a" * 8192)
    assert _status(_answer(conn)) == 431


@pytest.mark.parametrize("sent, status, says", [
    (b"", None, b""),  # an idle connection: closed without a word
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 408, b"headers did not arrive"),  # headers that stop coming
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
     b'{"prompt": ', 408, b"body did not arrive"),  # a body shorter than its Content-Length
], ids=["idle", "header-trickle", "short-body"])
def test_a_connection_that_stops_sending_is_closed_at_its_timeout(gateway, sent, status, says):
    conn = _connect(gateway)
    conn.sendall(sent)
    answer = _answer(conn)  # (a socket timeout here, WAIT_S, would fail the test: the gateway never closed it)
    assert _status(answer) == status and says in answer, answer[:300]


def test_a_header_trickle_does_not_outlive_the_header_timeout(gateway):
    """One byte at a time, each well within the keep-alive time: the deadline is the headers', not per byte."""
    conn = _connect(gateway)
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: 1\r\n" * 1000
    deadline = time.monotonic() + WAIT_S
    try:
        for byte in request:
            conn.sendall(bytes([byte]))
            time.sleep(0.05)
            assert time.monotonic() < deadline, "still open after WAIT_S"
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert _status(_answer(conn)) in (408, None)


def test_connections_past_the_cap_are_answered_503_and_counted(gateway):
    before = _refused(gateway[2]).get("over_capacity", 0)
    conns = [_connect(gateway) for _ in range(LIMITS.max_connections + 3)]
    try:
        deadline = time.monotonic() + WAIT_S
        while len(gateway[3].connections) < len(conns):  # the gateway has taken them all
            assert time.monotonic() < deadline
            time.sleep(0.01)
        statuses = []
        for conn in conns:
            conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            statuses.append(_status(_answer(conn)))
    finally:
        for conn in conns:
            conn.close()
    assert statuses.count(503) >= 3 and 503 not in statuses[:LIMITS.max_connections - 1], statuses
    deadline = time.monotonic() + WAIT_S
    while _refused(gateway[2]).get("over_capacity", 0) < before + 3:  # (a scrape may land past the cap too)
        assert time.monotonic() < deadline
    assert httpx.get(f"{gateway[2]}/v1/models", timeout=WAIT_S).status_code == 200  # below the cap again


def test_every_refusal_is_counted_by_reason(gateway):
    counts = _refused(gateway[2])
    for reason in ("too_large", "content_type", "header_too_large", "header_timeout", "body_timeout"):
        assert counts.get(reason, 0) >= 1, (reason, counts)


def test_the_limits_flags_round_trip_to_the_worker_processes():
    """--workers starts each process with the same limits (GatewayLimits.flags), and a bad value names its flag."""
    parser = argparse.ArgumentParser()
    add_limit_flags(parser)
    assert limits_from_args(parser.parse_args(LIMITS.flags())) == LIMITS
    assert limits_from_args(parser.parse_args([])) == GatewayLimits()
    with pytest.raises(ValueError, match="--header-timeout must be > 0"):
        limits_from_args(parser.parse_args(["--header-timeout", "0"]))
