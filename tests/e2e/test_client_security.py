"""The client API's edge, on a real controller (the tiny model in-process, real gRPC on 127.0.0.1): a bearer token
(none, wrong and right; health stays open), TLS with a CA made here by openssl, mutual TLS refused without a client
certificate, and bytes that do not decode or are too large getting INVALID_ARGUMENT / RESOURCE_EXHAUSTED, and prompt
text over the byte limit refused before tokenizing."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from shardserve.client.clients import Client
from shardserve.cluster.api_security import ApiSecurity
from shardserve.proto import generation_pb2 as pb

TOKEN = "s3cret-token"
PROMPT = [1, 5, 9, 13]
GENERATE = "/shardserve.v1.Generation/Generate"


def _serve(e2e_config, model_dir: str, security: ApiSecurity, **controller):
    from shardserve.cluster.controller import ControllerConfig, ServedModel
    from shardserve.cluster.engine import Engine
    from shardserve.worker.inprocess import InProcessExecutor
    from tests.e2e._controller_thread import ControllerThread

    served = ControllerThread(ControllerConfig(
        engine=e2e_config(model_dir),
        model=ServedModel("tiny", "LlamaForCausalLM", vocab_size=384, eos_token_ids=[]),
        build_engine=lambda config: Engine(config, InProcessExecutor(config), vocab_size=384),
        port=0,
        security=security,
        **controller,
    ))
    assert served.call(served.controller.wait_ready(120))
    return served


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""
    d = tmp_path_factory.mktemp("certs")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=shardserve test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text(ext + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def token_server(tiny_llama_dir, e2e_config):
    served = _serve(e2e_config, tiny_llama_dir, ApiSecurity(token=TOKEN, max_request_bytes=64 * 1024,
                                                                 max_prompt_bytes=4096))
    yield served
    served.close()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def test_no_token_and_a_wrong_token_are_unauthenticated_a_good_one_generates(token_server):
    with Client(token_server.address, timeout=60) as anonymous:
        assert anonymous.health() == "SERVING"  # health stays open
        assert _code(lambda: anonymous.generate(PROMPT, max_tokens=4)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(anonymous.server_stats) == grpc.StatusCode.UNAUTHENTICATED
    with Client(token_server.address, timeout=60, token="s3cret-tokem") as wrong:
        assert _code(lambda: wrong.generate(PROMPT, max_tokens=4)) == grpc.StatusCode.UNAUTHENTICATED
    with Client(token_server.address, timeout=60, token=TOKEN) as good:
        assert good.generate(PROMPT, max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
        assert good.server_stats().kv_blocks_used == 0


def _raw_generate(address: str, payload: bytes, token: str | None = TOKEN) -> tuple[grpc.StatusCode, str]:
    """Sends bytes as they are (no serializer) to Generate; returns the status the call ends with."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(GENERATE)(payload, timeout=30, metadata=metadata)
        with pytest.raises(grpc.RpcError) as error:
            list(call)
    return error.value.code(), error.value.details()


def _text_field(value: bytes) -> bytes:
    """GenerateRequest with its `text` string field set to raw bytes (which may not be UTF-8)."""
    number = pb.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number
    assert len(value) < 128
    return bytes([number << 3 | 2, len(value)]) + value


def test_bytes_that_do_not_decode_get_invalid_argument_with_the_reason(token_server):
    assert pb.GenerateRequest.FromString(_text_field(b"hello")).text == "hello"  # the encoding is right
    code, details = _raw_generate(token_server.address, _text_field(b"caf\xc3\x28 \xff"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not decode" in details
    code, details = _raw_generate(token_server.address, b"\xff\xff\xff\xff not a protobuf")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in details


def test_a_message_over_max_request_bytes_is_resource_exhausted_and_the_server_still_serves(token_server):
    big = pb.GenerateRequest(text="x" * (64 * 1024)).SerializeToString()
    code, _ = _raw_generate(token_server.address, big)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with Client(token_server.address, timeout=60, token=TOKEN) as client:
        assert client.generate(PROMPT, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_prompt_text_over_max_prompt_bytes_is_invalid_argument_naming_the_limit(token_server):
    with Client(token_server.address, timeout=60, token=TOKEN) as client:
        with pytest.raises(grpc.RpcError) as error:
            client.generate("é" * 2049, max_tokens=2)  # 4098 bytes of UTF-8, under max_request_bytes
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "4098 bytes" in error.value.details() and "limit of 4096 bytes (--max-prompt-bytes)" in error.value.details()


def test_tls_with_a_ca_made_here_and_plaintext_refused(certs, tiny_llama_dir, e2e_config):
    served = _serve(e2e_config, tiny_llama_dir, ApiSecurity(tls_cert=certs["server.pem"], tls_key=certs["server.key"]))
    try:
        with Client(served.address, timeout=60, tls_root_cert=certs["ca.pem"]) as client:
            assert client.generate(PROMPT, max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        with Client(served.address, timeout=5) as plaintext:
            assert _code(plaintext.health) == grpc.StatusCode.UNAVAILABLE
        with Client(served.address, timeout=5, tls_root_cert=certs["client.pem"]) as untrusted:  # not the CA
            assert _code(untrusted.health) == grpc.StatusCode.UNAVAILABLE
    finally:
        served.close()


def test_mutual_tls_refuses_a_client_without_a_certificate(certs, tiny_llama_dir, e2e_config):
    served = _serve(e2e_config, tiny_llama_dir, ApiSecurity(tls_cert=certs["server.pem"], tls_key=certs["server.key"],
                                                            client_ca=certs["ca.pem"]))
    try:
        with Client(served.address, timeout=5, tls_root_cert=certs["ca.pem"]) as no_cert:
            assert _code(no_cert.health) == grpc.StatusCode.UNAVAILABLE
        with Client(served.address, timeout=60, tls_root_cert=certs["ca.pem"], tls_client_cert=certs["client.pem"],
                    tls_client_key=certs["client.key"]) as client:
            assert client.generate(PROMPT, max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
    finally:
        served.close()


def test_the_gateway_forwards_the_bearer_token_401_without_it(token_server):
    import httpx

    from shardserve.gateway.app import GatewayThread

    gateway = GatewayThread(token_server.address, "127.0.0.1", 0)
    try:
        body = {"prompt": PROMPT, "max_tokens": 2}
        url = f"http://{gateway.address}/v1/completions"
        refused = httpx.post(url, json=body, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=60)
        assert wrong.status_code == 401
        ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 2
    finally:
        gateway.stop()


def test_one_rule_on_every_gateway_path_but_health_cached_model_card_included(token_server):
    """The server asks for a token: after an authorized caller has filled the gateway's model-info cache, a caller
    without the token (or with a wrong one) still gets 401 on /v1/models, /v1/models/{id} and /metrics, as on the
    generation paths; /health stays open."""
    import httpx

    from shardserve.gateway.app import GatewayThread

    gateway = GatewayThread(token_server.address, "127.0.0.1", 0)
    good = {"Authorization": f"Bearer {TOKEN}"}
    try:
        base = f"http://{gateway.address}"
        assert httpx.get(f"{base}/v1/models", headers=good, timeout=60).status_code == 200  # cached now
        assert httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=good,
                          timeout=60).status_code == 200
        for path in ("/v1/models", "/v1/models/tiny", "/metrics"):
            for headers in ({}, {"Authorization": "Bearer nope"}):
                refused = httpx.get(base + path, headers=headers, timeout=60)
                assert refused.status_code == 401, (path, headers, refused.text)
                assert refused.json()["error"]["type"] == "authentication_error"
            assert httpx.get(base + path, headers=good, timeout=60).status_code == 200, path
        assert httpx.get(f"{base}/health", timeout=60).status_code == 200
    finally:
        gateway.stop()
