"""`shardserve client`: one prompt streamed to the terminal, or a JSON-lines file of prompts sent concurrently, against
a running `shardserve serve` (the gRPC client API), added to shardserve/cli/main.py's parser.

What a request asks for comes back: with one prompt, `--logprobs N` / `--prompt-logprobs N` are printed on stderr
as `generate` prints them; with --file, each result line carries the text, token ids, finish and stop reason, usage
(cached prompt tokens included) and, where asked for, logprobs. A line that is not a JSON object with a prompt gets
an error record naming the file and line, and the other lines are still sent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from shardserve.cli.connection_flags import add_connection_args, connection_kwargs
from shardserve.cli.flags import add_sampling_args, sampling_kwargs

PROMPT_KEYS = ("prompt", "messages", "token_ids")


def add_client_parser(sub) -> None:
    client = sub.add_parser("client", help="send prompts to a running `shardserve serve`")
    client.add_argument("prompt", nargs="?", help="one prompt; its text is printed as it arrives")
    client.add_argument("--address", default="127.0.0.1:50051", help="the server's gRPC address, HOST:PORT")
    client.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    client.add_argument("--file", help="a JSON-lines file of prompts: {\"prompt\": ...} or {\"messages\": [...]} "
                        "or {\"token_ids\": [...]}, optionally with sampling fields")
    client.add_argument("--concurrency", type=int, default=8, help="requests in flight with --file")
    client.add_argument("--output", help="with --file: write the JSON-lines results here (default: stdout)")
    client.add_argument("--timeout", type=float, default=None, help="deadline per request, seconds")
    add_connection_args(client)
    add_sampling_args(client)
    client.set_defaults(func=cmd_client)


def cmd_client(args: argparse.Namespace) -> int:
    import grpc

    from shardserve.client.clients import Client

    if (args.prompt is None) == (args.file is None):
        print("error: give a prompt or --file (not both)", file=sys.stderr)
        return 2
    if args.file is not None and not os.path.isfile(args.file):
        why = "is a folder, not a file" if os.path.isdir(args.file) else "does not exist"
        print(f"error: --file {args.file} {why}", file=sys.stderr)
        return 2
    try:
        connection = connection_kwargs(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with Client(args.address, timeout=args.timeout, **connection) as client:
        try:
            if args.file:
                return _run_batch(client, args)
            return _run_one(client, args)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1


def _run_one(client, args: argparse.Namespace) -> int:
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    stream = client.stream(prompt, **sampling_kwargs(args))
    for delta in stream:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    r = stream.result
    if r.prompt_logprobs:
        print_logprobs("prompt", r.prompt_logprobs)
    if r.logprobs:
        print_logprobs("generated", r.logprobs)
    stop = f" ({r.stop_reason!r})" if r.stop_reason is not None else ""
    cached = f", {r.usage.cached_prompt_tokens} cached" if r.usage.cached_prompt_tokens else ""
    print(f"[{r.finish_reason}{stop}: {r.usage.prompt_tokens} prompt{cached} + {r.usage.completion_tokens} generated "
          f"tokens, {r.replica}]", file=sys.stderr)
    return 0


def print_logprobs(title: str, positions) -> None:
    """One line per position on stderr: the token, its logprob and rank, then the top alternatives."""
    print(f"[{title} logprobs: token (logprob, rank) | top]", file=sys.stderr)
    for entries in positions:
        if entries is None:
            print("  (first token: none)", file=sys.stderr)
            continue
        (token, chosen), *others = entries.items()
        top = "  ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for _, lp in others)
        print(f"  {chosen.decoded_token!r} ({chosen.logprob:.3f}, {chosen.rank}) | {top}", file=sys.stderr)


def _positions(positions) -> list | None:
    """Logprobs as JSON: per position a list of {token_id, logprob, rank, decoded_token} (the chosen token first);
    a position without any (the prompt's first token) is null."""
    if positions is None:
        return None
    return [None if p is None else [{"token_id": t, "logprob": lp.logprob, "rank": lp.rank,
                                     "decoded_token": lp.decoded_token} for t, lp in p.items()] for p in positions]


class _BadLine:
    """A line of the file that is no request: its number and why."""

    def __init__(self, number: int, message: str, id=None) -> None:
        self.number, self.message, self.id = number, message, id


def _parse(path: str) -> list:
    """(line number, object) per non-blank line, or a _BadLine for a line that is not a JSON object with a prompt."""
    lines = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                body = json.loads(text)
            except json.JSONDecodeError as e:
                lines.append(_BadLine(number, f"not JSON ({e})"))
                continue
            if not isinstance(body, dict) or not any(k in body for k in PROMPT_KEYS):
                lines.append(_BadLine(number, "a line is a JSON object with prompt, messages or token_ids",
                                      body.get("id") if isinstance(body, dict) else None))
                continue
            lines.append((number, body))
    return lines


def _one(client, path: str, index: int, line, defaults: dict) -> dict:
    """One line's result record ("line": its number in the file; an error names the file and line)."""
    import grpc

    if isinstance(line, _BadLine):
        record = {"index": index, "line": line.number}
        if line.id is not None:
            record["id"] = line.id
        record["error"] = {"code": "INVALID_ARGUMENT", "message": f"{path} line {line.number}: {line.message}"}
        return record
    number, body = line
    record: dict = {"index": index, "line": number}
    if "id" in body:
        record["id"] = body["id"]
    sampling = {**defaults, **{k: v for k, v in body.items() if k not in (*PROMPT_KEYS, "id")}}
    try:
        r = client.generate(body[next(k for k in PROMPT_KEYS if k in body)], **sampling)
        record.update(request_id=r.request_id, text=r.text, token_ids=r.token_ids, finish_reason=r.finish_reason,
                      stop_reason=r.stop_reason,
                      usage={"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                             "cached_prompt_tokens": r.usage.cached_prompt_tokens},
                      replica=r.replica)
        if r.logprobs is not None:
            record["logprobs"] = _positions(r.logprobs)
        if r.prompt_logprobs is not None:
            record["prompt_logprobs"] = _positions(r.prompt_logprobs)
    except grpc.RpcError as e:
        record["error"] = {"code": e.code().name, "message": f"{path} line {number}: {e.details()}"}
    except (ValueError, TypeError) as e:
        record["error"] = {"code": "INVALID_ARGUMENT", "message": f"{path} line {number}: {e}"}
    return record


def _run_batch(client, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    lines = _parse(args.file)
    out = open(args.output, "w") if args.output else sys.stdout
    defaults = sampling_kwargs(args)
    failures = 0
    try:
        with ThreadPoolExecutor(max(1, args.concurrency)) as pool, \
                tqdm(total=len(lines), desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
            futures = [pool.submit(_one, client, args.file, i, line, defaults) for i, line in enumerate(lines)]
            for future in futures:
                future.add_done_callback(lambda _: bar.update(1))
            for future in futures:  # written in input order, each as soon as it and those before it are done
                record = future.result()
                if "error" in record:
                    failures += 1
                    bar.write(f"error: {record['error']['code']}: {record['error']['message']}", file=sys.stderr)
                out.write(json.dumps(record) + "\n")
                out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
    if failures:
        print(f"{failures} of {len(lines)} request(s) failed", file=sys.stderr)
    return 1 if failures else 0
