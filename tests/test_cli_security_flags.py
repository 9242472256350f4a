"""The security flags' mistakes end in one line naming the flag or file, before Ray starts (the real CLI as a
subprocess)."""

from __future__ import annotations

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
