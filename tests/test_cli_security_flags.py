"""The security flags' mistakes end in one line naming the flag or file, before Ray starts (the real CLI as a
subprocess)."""

from __future__ import annotations

import pytest

from tests.test_cli_errors import assert_one_line_error, shardserve


def test_serve_with_a_missing_token_file_names_it(tmp_path):
    missing = tmp_path / "nope.txt"
    assert_one_line_error(shardserve("serve", "--port", "0", "--auth-token-file", str(missing)),
                          "--auth-token-file", str(missing))


def test_serve_with_an_empty_token_file_says_so(tmp_path):
    empty = tmp_path / "token.txt"
    empty.write_text("\n")
    assert_one_line_error(shardserve("serve", "--port", "0", "--auth-token-file", str(empty)), "empty", str(empty))


def test_serve_with_a_certificate_but_no_key_names_both_flags(tmp_path):
    cert = tmp_path / "server.pem"
    cert.write_text("not checked before the key")
    assert_one_line_error(shardserve("serve", "--port", "0", "--tls-cert", str(cert)), "--tls-cert", "--tls-key")


def test_client_with_a_missing_token_file_names_it(tmp_path):
    missing = tmp_path / "nope.txt"
    done = shardserve("client", "hi", "--token-file", str(missing))
    assert_one_line_error(done, str(missing))


def _serve_token(*flags: str, env: str | None = None, monkeypatch=None) -> str | None:
    from shardserve.cli.main import build_parser
    from shardserve.cli.server_commands import API_KEY_ENV, api_security

    if env is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, env)
    return api_security(build_parser().parse_args(["serve", *flags])).token


def test_serve_takes_the_token_as_api_key_or_from_the_environment_as_vllm_users_give_it(tmp_path, monkeypatch):
    token_file = tmp_path / "token.txt"
    token_file.write_text("from-file\n")
    assert _serve_token(monkeypatch=monkeypatch) is None
    assert _serve_token("--api-key", "k3y", monkeypatch=monkeypatch) == "k3y"
    assert _serve_token(env="from-env", monkeypatch=monkeypatch) == "from-env"
    assert _serve_token("--api-key", "k3y", env="from-env", monkeypatch=monkeypatch) == "k3y"  # the flag wins
    assert _serve_token("--auth-token-file", str(token_file), env="e", monkeypatch=monkeypatch) == "from-file"
    with pytest.raises(ValueError, match="--auth-token-file and --api-key"):
        _serve_token("--auth-token-file", str(token_file), "--api-key", "k", monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="SHARDSERVE_API_KEY is empty"):
        _serve_token(env=" ", monkeypatch=monkeypatch)


def test_client_sends_api_key_or_the_environment_token(monkeypatch):
    from shardserve.cli.main import build_parser
    from shardserve.cli.connection_flags import API_KEY_ENV, connection_kwargs

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert connection_kwargs(build_parser().parse_args(["client", "hi"]))["token"] == "from-env"
    assert connection_kwargs(build_parser().parse_args(["client", "hi", "--api-key", "k"]))["token"] == "k"
