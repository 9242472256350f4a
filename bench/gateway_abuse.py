"""`shardserve bench gateway-abuse`: the HTTP gateway under abuse, a bounded run that reports each case's status
codes and timings and the gateway process's memory before and after.

    shardserve bench gateway-abuse                        # starts `serve --http-port 0` (the default model, CPU)
    shardserve bench gateway-abuse --http http://127.0.0.1:8000 --address 127.0.0.1:50051 --pid PID   # a running one

The cases: 200 MB bodies (three times), a chunked 64 MB body, 5,000 prompts, a body that is not JSON, a 100 KB
header, a header trickle, a body shorter than its Content-Length, idle connections, connections past the cap, and
the three large fields whose refusals once lost their status (1,025 logit_bias entries, 5,000 stop strings ending in
"", 5,000 stop_token_ids ending in -1) over HTTP and over gRPC; a normal greedy request before and after (its
latency and text). Memory: the RSS of the process serving the gateway (for `serve --http-port`, the serve process).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

PROMPT = "The capital of France is"


def add_gateway_abuse_parser(kinds, add_engine_args, run) -> None:
    parser = kinds.add_parser("gateway-abuse", help="the HTTP gateway under abuse: status codes, timings, memory")
    add_engine_args(parser)
    parser.add_argument("--http", default=None, metavar="URL", help="a running gateway (default: start a server)")
    parser.add_argument("--address", default=None, metavar="HOST:PORT", help="its gRPC server (the gRPC cases)")
    parser.add_argument("--pid", type=int, default=None, help="the process serving --http (its memory is reported)")
    parser.add_argument("--header-timeout", type=float, default=3.0,
                        help="the started server's gateway --http-header-timeout (and --http-body-timeout)")
    parser.add_argument("--max-connections", type=int, default=64, help="the started server's --http-max-connections")
    parser.add_argument("--idle-connections", type=int, default=300, help="connections opened and left idle")
    parser.add_argument("--json-out", default=None, help="write the result as a JSON record to this file")
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    parser.set_defaults(func=run, engine_defaults=vars(engine.parse_args([])))


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    import psutil

    from shardserve.bench.record import BenchRecord, device_name
    from shardserve.bench.serve_server import LaunchedServer, engine_flags

    server = None
    if args.http is None:
        limits = ["--http-header-timeout", str(args.header_timeout), "--http-body-timeout", str(args.header_timeout),
                  "--http-max-connections", str(args.max_connections)]
        server = LaunchedServer(engine_flags(args) + limits, http=True)
        base, address, pid = server.http_url, server.address, server.proc.pid
    else:
        base, address, pid = args.http.rstrip("/").removesuffix("/v1"), args.address, args.pid
    process = psutil.Process(pid) if pid else None
    try:
        cases, memory = run_cases(base, address, process, args)
    finally:
        if server is not None:
            server.stop()
    print(f"{'case':44} {'statuses':28} {'seconds':>10}")
    for case in cases:
        print(f"{case['case']:44} {','.join(map(str, case['statuses']))[:28]:28} {case['seconds']:>10.3f}")
    print(f"gateway RSS: {memory['before_mb']:.0f} MB before, {memory['peak_mb']:.0f} MB at most, "
          f"{memory['after_mb']:.0f} MB after ({memory['after_mb'] - memory['before_mb']:+.0f} MB)")
    record = BenchRecord(benchmark="gateway-abuse", model=engine_kwargs.get("model") or "SmolLM2-135M-Instruct",
                         load_format=engine_kwargs.get("load_format") or "auto", device=device_name("cpu"),
                         num_gpus=0, tp=1, workload={"http": base, "started_server": server is not None},
                         notes={"cases": cases, "memory": memory})
    record.write(args.json_out)
    return 0


def run_cases(base: str, address: str | None, process, args) -> tuple[list[dict], dict]:
    import httpx

    host, port = base.removeprefix("http://").rsplit(":", 1)
    cases: list[dict] = []
    peak = [0.0]

    def rss() -> float:
        if process is None:
            return 0.0
        mb = process.memory_info().rss / 2**20
        peak[0] = max(peak[0], mb)
        return mb

    def case(name: str, send) -> None:
        start = time.perf_counter()
        statuses = send()
        cases.append({"case": name, "statuses": statuses, "seconds": round(time.perf_counter() - start, 4),
                      "rss_mb": round(rss(), 1)})

    client = httpx.Client(base_url=base, timeout=120)
    normal = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}

    def greedy() -> list:
        reply = client.post("/v1/completions", json=normal)
        greedy.texts.append(reply.json()["choices"][0]["text"] if reply.status_code == 200 else reply.text)
        return [reply.status_code]

    greedy.texts = []
    for _ in range(3):  # warm: the first request pays for the model info and the channel
        greedy()
    case("normal request before", lambda: [greedy()[0] for _ in range(5)])
    before = rss()
    big = b'{"prompt": "' + b"x" * (200 * 2**20) + b'"}'
    for i in range(3):  # the time until the gateway's answer, its body being sent meanwhile as a client would
        case(f"200 MB body ({i + 1})", lambda: [_big_body(host, port, big)])
    case("200 MB body, httpx (its own time to send)", lambda: [_post(base, big)])
    del big
    case("chunked 64 MB body", lambda: [_post(base, (b"x" * 2**20 for _ in range(64)))])
    case("5,000 prompts", lambda: [client.post("/v1/completions", json={"prompt": ["a"] * 5000}).status_code])
    case("Content-Type text/plain", lambda: [client.post("/v1/completions", content=json.dumps(normal),
                                                         headers={"content-type": "text/plain"}).status_code])
    case('max_tokens: "8"', lambda: [client.post("/v1/completions", json={**normal, "max_tokens": "8"}).status_code])
    case("100 KB header", lambda: [_raw_status(host, port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " +
                                               b"a" * 100_000 + b"\r\n\r\n")])
    large = {"1,025 logit_bias entries": {"logit_bias": {str(t): 1.0 for t in range(1025)}},
             '5,000 stop strings ending in ""': {"stop": ["stop"] * 4999 + [""]},
             "5,000 stop_token_ids ending in -1": {"stop_token_ids": list(range(4999)) + [-1]}}
    for name, fields in large.items():
        case(f"{name} (HTTP)", lambda: [_with_reason(client.post("/v1/completions", json={**normal, **fields}))])
        if address:
            case(f"{name} (gRPC)", lambda: [_grpc_code(address, fields)])
    case("header trickle, 1 byte / 0.5 s", lambda: [_trickle(host, port)])
    case("body shorter than Content-Length", lambda: [_raw_status(host, port, (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        b'{"prompt": '))])
    case(f"{args.idle_connections} idle connections", lambda: _idle(host, port, args.idle_connections))
    case("past the connection cap", lambda: _past_cap(host, port, args.max_connections + 20))
    client.close()
    client = httpx.Client(base_url=base, timeout=120)
    case("normal request after", lambda: [greedy()[0] for _ in range(5)])
    after = rss()
    deadline = time.monotonic() + 30  # memory the allocator has not handed back yet: a few seconds at most
    while after - before > 50 and time.monotonic() < deadline:
        time.sleep(1)
        after = rss()
    normal_before = [c for c in cases if c["case"] == "normal request before"][0]
    normal_after = [c for c in cases if c["case"] == "normal request after"][0]
    memory = {"before_mb": round(before, 1), "peak_mb": round(peak[0], 1), "after_mb": round(after, 1),
              "same_greedy_text": len(set(greedy.texts)) == 1,
              "normal_latency_ms_before": round(normal_before["seconds"] / 5 * 1000, 1),
              "normal_latency_ms_after": round(normal_after["seconds"] / 5 * 1000, 1)}
    client.close()
    return cases, memory


def _post(base: str, body) -> int | str:
    import httpx

    try:
        return httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=120).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def _big_body(host: str, port: str, body: bytes) -> int | str:
    """POSTs body with its Content-Length, 1 MB at a time, until the gateway answers (or all of it is sent)."""
    import select

    conn = _connect(host, port)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    view = memoryview(body)
    try:
        for at in range(0, len(body), 2**20):
            if select.select([conn], [], [], 0)[0]:
                break  # the answer came
            conn.sendall(view[at:at + 2**20])
    except (BrokenPipeError, ConnectionResetError):
        pass
    return _answer(conn)


def _with_reason(reply) -> str:
    error = reply.json().get("error", {}) if reply.status_code != 200 else {}
    return f"{reply.status_code} {error.get('param')}: {error.get('message', '')[:60]}"


def _grpc_code(address: str, fields: dict) -> str:
    import grpc

    from shardserve.client.clients import Client

    sampling = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()}
    with Client(address, timeout=60) as client:
        try:
            client.generate(PROMPT, max_tokens=1, **sampling)
            return "OK"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()[:60]}"


def _connect(host: str, port: str) -> socket.socket:
    conn = socket.create_connection((host, int(port)))
    conn.settimeout(60)
    return conn


def _answer(conn: socket.socket) -> int | str:
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except (ConnectionResetError, socket.timeout) as e:
        if not data:
            return type(e).__name__
    conn.close()
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else "closed"


def _raw_status(host: str, port: str, request: bytes) -> int | str:
    conn = _connect(host, port)
    try:
        conn.sendall(request)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return _answer(conn)


def _trickle(host: str, port: str) -> int | str:
    conn = _connect(host, port)
    try:
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: 1\r\n" * 1000:
            conn.sendall(bytes([byte]))
            time.sleep(0.5)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return _answer(conn)


def _idle(host: str, port: str, count: int) -> list:
    """Opens `count` connections and sends nothing: what each gets, once the gateway has closed them all."""
    conns = [_connect(host, port) for _ in range(count)]
    return sorted({str(a) for a in (_answer(c) for c in conns)})


def _past_cap(host: str, port: str, count: int) -> list:
    """`count` connections opened at once, then a request on each: the statuses they got, counted."""
    conns = [_connect(host, port) for _ in range(count)]
    time.sleep(0.5)  # (lets the gateway accept them all before the first request ends and frees a place)
    for conn in conns:
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answers = [str(_answer(c)) for c in conns]
    return [f"{a} x{answers.count(a)}" for a in sorted(set(answers))]


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: shardserve bench gateway-abuse")
