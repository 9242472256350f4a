"""How a client command reaches a server: the bearer token (--token-file, --api-key, $SHARDSERVE_API_KEY) and TLS
flags of `shardserve client` and of the gateway's upstream (prefixed), and the token rule `serve` shares."""

from __future__ import annotations

import argparse
import os

# The token from the environment, where no flag gives one (serve: the one clients must send; client: the one it sends),
# as vLLM reads VLLM_API_KEY and OpenAI's SDK OPENAI_API_KEY. A secret, not an engine setting.
API_KEY_ENV = "SHARDSERVE_API_KEY"


def token_of(token_file: str | None, api_key: str | None, token_flag: str) -> str | None:
    """The bearer token of --token-file / --auth-token-file (token_flag names it), --api-key or $SHARDSERVE_API_KEY,
    in that order; None when none is given. Both flags at once: a ValueError naming them."""
    from shardserve.proto.auth import read_token_file

    if token_file and api_key:
        raise ValueError(f"{token_flag} and --api-key both give the token: give one")
    if token_file:
        return read_token_file(token_file)
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(("--api-key" if api_key is not None else API_KEY_ENV) + " is empty")
    return key.strip() if key else None


def add_connection_args(parser, prefix: str = "") -> None:
    """How a client reaches a server with a token or TLS (the client command; the gateway's upstream, prefixed)."""
    if not prefix:
        parser.add_argument("--token-file", default=None, metavar="PATH", help="send the bearer token in this file")
        parser.add_argument("--api-key", default=None, metavar="KEY",
                            help="send this bearer token (default: the environment variable " + API_KEY_ENV + ")")
    parser.add_argument(f"--{prefix}tls-ca", default=None, metavar="PEM",
                        help="connect over TLS, verifying the server with this CA certificate")
    parser.add_argument(f"--{prefix}tls", action="store_true", help="connect over TLS with the system's CA roots")
    parser.add_argument(f"--{prefix}tls-cert", default=None, metavar="PEM", help="mutual TLS: this client's certificate")
    parser.add_argument(f"--{prefix}tls-key", default=None, metavar="PEM", help="mutual TLS: the key of that certificate")


def connection_kwargs(args: argparse.Namespace, prefix: str = "") -> dict:
    """Client/AsyncClient keywords from add_connection_args' flags."""
    p = prefix.replace("-", "_")
    token = None if prefix else token_of(args.token_file, args.api_key, "--token-file")
    return dict(token=token, tls=getattr(args, f"{p}tls"),
                tls_root_cert=getattr(args, f"{p}tls_ca"), tls_client_cert=getattr(args, f"{p}tls_cert"),
                tls_client_key=getattr(args, f"{p}tls_key"))
